"""`wire_security: tag` (vitserve/rpc/tag.py): the push wire keyed by a tag per message instead of CURVE. The tag
itself (what it covers, replays, the clock), then a real connector store and a real LLMSender over ZMQ on
loopback: delivered whole, a stranger's or an untagged message never kept and the receiver serving on, an address
accept_from does not admit refused at the handshake, and the words a sender gets for each mismatch."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import zmq

from tests.connector_messages import WIDTH, message
from vitserve.connector.allowlist import Allowlist
from vitserve.connector.config import parse_config
from vitserve.connector.store import EmbeddingStore, Shape, read_entry
from vitserve.handover.same_host import SameHost, probe
from vitserve.rpc import tag
from vitserve.rpc.delivery import Unsent
from vitserve.rpc.replies import Ack, decode_reply
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.tag import TO_CONNECTOR, TO_SENDER, TagError, Tagger
from vitserve.rpc.wire import encode_embedding_message

SECRET = b"t" * 32
LOOPBACK = Allowlist(["127.0.0.0/8"], "accept_from")
REPLY_S = 30.0  # a reply that must come; one that must not is waited for 1 s


def test_a_sealed_message_opens_to_its_frames_whatever_they_are():
    sender, receiver = Tagger(SECRET, sends=TO_CONNECTOR), Tagger(SECRET, sends=TO_SENDER)
    tensor = torch.arange(24.0).reshape(
        2, 3, 4
    )  # a 3-dimensional view's bytes, as encode_embedding_message gives
    frames = [b"header", memoryview(tensor.numpy()), b"", bytearray(b"tail")]
    sealed = sender.seal(frames)
    assert [len(memoryview(f).tobytes()) for f in sealed[3:]] == [4, tag.TAG_FRAME_BYTES]
    assert receiver.open([bytes(memoryview(f)) for f in sealed]) == [bytes(memoryview(f)) for f in frames]


@pytest.mark.parametrize(
    "change",
    [
        lambda f: [b"heaDer", *f[1:]],  # one byte of a frame
        lambda f: [b"heade", b"r" + f[1], *f[2:]],  # the same bytes, another split between frames
        lambda f: [f[1], f[0], f[2]],  # frames in another order
        lambda f: f[:1] + f[2:],  # a frame left out
        lambda f: [*f[:2], f[2][:-1] + bytes([f[2][-1] ^ 1])],  # the tag itself
    ],
)
def test_a_changed_message_does_not_open(change):
    sealed = Tagger(SECRET, sends=TO_CONNECTOR).seal([b"header", b"tensor bytes"])
    with pytest.raises(TagError):
        Tagger(SECRET, sends=TO_SENDER).open(change(sealed))


def test_another_secret_a_reflected_reply_and_no_tag_do_not_open():
    sealed = Tagger(SECRET, sends=TO_CONNECTOR).seal([b"m"])
    with pytest.raises(TagError, match="different secrets"):
        Tagger(b"u" * 32, sends=TO_SENDER).open(sealed)
    reply = Tagger(SECRET, sends=TO_SENDER).seal([b"m"])
    with pytest.raises(TagError, match="different secrets"):  # a reply played back to the connector
        Tagger(SECRET, sends=TO_SENDER).open(reply)
    with pytest.raises(TagError, match="no tag frame"):
        Tagger(SECRET, sends=TO_SENDER).open([b"m"])
    with pytest.raises(TagError, match="not a tag"):
        Tagger(SECRET, sends=TO_SENDER).open([b"m", b"x" * tag.TAG_FRAME_BYTES])


def test_a_replay_and_a_stale_message_are_refused(monkeypatch):
    receiver = Tagger(SECRET, sends=TO_SENDER)
    sealed = Tagger(SECRET, sends=TO_CONNECTOR).seal([b"m"])
    assert receiver.open(sealed) == [b"m"]
    with pytest.raises(TagError, match="seen before"):
        receiver.open(sealed)
    stale = Tagger(SECRET, sends=TO_CONNECTOR).seal([b"n"])
    later = time.time_ns() + int((tag.WINDOW_S + 5) * 1e9)
    monkeypatch.setattr(tag.time, "time_ns", lambda: later)  # the receiver's clock, a window and 5 s on
    with pytest.raises(TagError, match="clock"):
        Tagger(SECRET, sends=TO_SENDER).open(stale)


def test_a_message_that_failed_its_tag_leaves_its_nonce_free():
    receiver = Tagger(SECRET, sends=TO_SENDER)
    sealed = Tagger(SECRET, sends=TO_CONNECTOR).seal([b"m"])
    with pytest.raises(TagError):
        receiver.open([b"M", sealed[1]])  # a forgery with the real nonce does not burn it
    assert receiver.open(sealed) == [b"m"]


# ---------------------------------------------------------------------------------- over ZMQ, a real store


@contextlib.contextmanager
def tag_store(directory, accept_from: Allowlist = LOOPBACK):
    directory.mkdir(exist_ok=True)
    with contextlib.closing(
        EmbeddingStore(
            "tcp://127.0.0.1:*",
            10**6,
            Shape(WIDTH, 2),
            key=SECRET,
            directory=str(directory),
            accept_from=accept_from,
        )
    ) as store:
        yield store


def key_file(tmp_path, secret: bytes = SECRET) -> str:
    path = tmp_path / f"key-{secret[:1].decode()}"
    path.write_bytes(secret)
    return str(path)


def test_a_tagged_push_is_kept_whole_and_acknowledged(tmp_path):
    with tag_store(tmp_path / "shm") as store, LLMSender(
        store.endpoint, key_file=key_file(tmp_path), security="tag"
    ) as sender:  # fmt: skip
        m = message("1" * 64)
        sender.send(m, deadline=time.monotonic() + REPLY_S).acked.result(REPLY_S)
        entry = store.get("1" * 64)
        assert entry is not None
        expected = torch.cat([m.embedding, *m.deepstack], dim=1)
        assert torch.equal(read_entry(str(entry.path), "float32", entry.rows, WIDTH), expected)
        assert sender.holds(["1" * 64, "2" * 64], REPLY_S, deadline=time.monotonic() + REPLY_S) == {"1" * 64}


def test_the_same_host_hello_is_tagged_both_ways_and_one_write_follows(tmp_path):
    """vitserve's hello (handover/same_host.py probe) goes tagged and its answer is opened: then a push from
    this host is one file, adopted by the connector."""
    with tag_store(tmp_path / "shm") as store, LLMSender(
        store.endpoint, key_file=key_file(tmp_path), security="tag"
    ) as sender:  # fmt: skip
        assert sender.wait_reachable(REPLY_S)
        info = probe(store.endpoint, key_file(tmp_path), security="tag")
        assert info is not None
        assert (info.incoming, info.width) == (str(store.dir / ".incoming"), WIDTH)
        assert probe(store.endpoint, key_file(tmp_path, b"u" * 32), timeout_s=0.5, security="tag") is None
        same = SameHost(sender)
        m = message("9" * 64)
        same.send(m, time.monotonic() + REPLY_S, torch.float32).acked.result(REPLY_S)
        assert same.files == 1
        assert store.counters()["adopted"] == 1


def test_an_untagged_or_forged_message_is_never_kept_and_the_receiver_serves_on(tmp_path):
    with tag_store(tmp_path / "shm") as store:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(store.endpoint)
        try:
            sock.send_multipart(encode_embedding_message(message("3" * 64)))  # no tag
            forged = Tagger(b"f" * 32, sends=TO_CONNECTOR).seal(encode_embedding_message(message("4" * 64)))
            sock.send_multipart(forged)
            for _ in range(2):  # each answered with a nack its sender cannot open: nothing of it was kept
                assert sock.poll(int(REPLY_S * 1000))
                with pytest.raises(TagError):
                    Tagger(b"f" * 32, sends=TO_CONNECTOR).open(sock.recv_multipart())
            assert [store.get("3" * 64), store.get("4" * 64)] == [None, None]
            assert (store.counters()["rejected"], store.counters()["received"]) == (2, 0)
            good = Tagger(SECRET, sends=TO_CONNECTOR)
            sock.send_multipart(good.seal(encode_embedding_message(message("5" * 64))))
            assert sock.poll(int(REPLY_S * 1000))
            assert isinstance(decode_reply(good.open(sock.recv_multipart())[0]), Ack)
        finally:
            sock.close(0)


def test_an_address_accept_from_does_not_admit_is_refused_at_the_handshake(tmp_path):
    with tag_store(tmp_path / "shm", Allowlist(["10.0.0.0/8"], "accept_from")) as store, LLMSender(
        store.endpoint, key_file=key_file(tmp_path), security="tag"
    ) as sender:  # fmt: skip
        delivery = sender.send(message("6" * 64), deadline=time.monotonic() + 1.0)
        with pytest.raises(Unsent):  # never handed over: WireTransport's 502 then says link.refusal
            delivery.acked.result(REPLY_S)
        assert "refused this host's address" in (sender.link.refusal or "")
        assert "accept_from" in (sender.link.refusal or "")
        assert store.counters()["received"] == 0
        assert store.counters()["handshakes_failed"] >= 1


def test_a_sender_with_another_secret_is_told_so_at_its_deadline(tmp_path):
    with tag_store(tmp_path / "shm") as store, LLMSender(
        store.endpoint, key_file=key_file(tmp_path, b"u" * 32), security="tag"
    ) as sender:  # fmt: skip
        delivery = sender.send(message("7" * 64), deadline=time.monotonic() + 2.0)
        with pytest.raises(Exception, match="replies fail their tag"):
            delivery.acked.result(REPLY_S)
        assert store.get("7" * 64) is None


def test_a_curve_sender_and_a_tag_connector_name_the_mismatch(tmp_path):
    with tag_store(tmp_path / "shm") as store, LLMSender(
        store.endpoint, key_file=key_file(tmp_path), security="curve"
    ) as sender:  # fmt: skip
        delivery = sender.send(message("8" * 64), deadline=time.monotonic() + 2.0)
        with pytest.raises(Unsent):
            delivery.acked.result(REPLY_S)
        assert "wire_security" in (sender.link.refusal or "")


def test_the_connectors_config_says_what_tag_needs(tmp_path):
    config, _ = parse_config({"endpoint": "tcp://0.0.0.0:5600", "key_file": "k", "wire_security": "tag",
                              "accept_from": ["10.0.0.0/8"]})  # fmt: skip
    assert (config.wire_security, config.accept_from) == ("tag", ("10.0.0.0/8",))
    assert parse_config({"endpoint": "tcp://127.0.0.1:5600"})[0].wire_security == "curve"
    with pytest.raises(ValueError, match="set key_file"):
        parse_config({"endpoint": "tcp://127.0.0.1:5600", "wire_security": "tag"})
    with pytest.raises(ValueError, match="one of curve, tag"):
        parse_config({"endpoint": "tcp://127.0.0.1:5600", "key_file": "k", "wire_security": "none"})
    with pytest.raises(ValueError, match="accept_from admits senders by address"):
        parse_config({"endpoint": "tcp://127.0.0.1:5600", "key_file": "k", "accept_from": ["10.0.0.0/8"]})
    with pytest.raises(ValueError, match="accept_from entry"):
        parse_config({"endpoint": "tcp://127.0.0.1:5600", "key_file": "k", "wire_security": "tag",
                      "accept_from": ["0.0.0.0"]})  # fmt: skip


def test_accept_from_admits_peers_by_address():
    allow = Allowlist(["10.0.0.0/8", "::1"], "accept_from")
    assert [allow.admits_peer(a) for a in ("10.1.2.3", "::1", "::ffff:10.0.0.9")] == [True] * 3
    assert [allow.admits_peer(a) for a in ("11.0.0.1", "", "host")] == [False] * 3
    assert LOOPBACK.admits_peer("")  # ipc:// never leaves the host
