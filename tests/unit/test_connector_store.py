"""The scheduler side of vitserve's vLLM connector without vLLM (vitserve/connector/store.py): real ZMQ on loopback,
real files; what it keeps, refuses, evicts, expires and releases, what a worker reads back, protected mode, the
receiver's restart and the directory's lock. Hostile messages, a full device, the property test and the soak are in
test_connector_hostile.py."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest
import torch
import zmq

from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.rpc import wirekey
from vitserve.rpc.replies import Ack, Held, Nack, decode_reply, encode_holds, encode_release
from vitserve.rpc.wire import ImageEmbedding, encode_embedding_message

WIDTH = 24  # 8 main columns and 2 DeepStack levels of 8
SECRET = b"s" * 32
REPLY_MS = 30_000  # a reply that must come; a refused one is waited for 1 s


@pytest.fixture
def store(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 4 * 12 * WIDTH * 4, Shape(WIDTH, 2), directory=str(tmp_path))
    ) as s:
        yield s


def frames(
    uuid: str,
    rows: int = 12,
    grid=(1, 6, 8),
    expires_in: float = 60.0,
    dtype=torch.float32,
    request_id: str = "r",
) -> list:
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(rows, 8, generator=g).to(dtype) for _ in range(3)]
    message = ImageEmbedding(
        request_id=request_id,
        image_index=0,
        num_images=1,
        image_id="0" * 64,
        grid_thw=grid,
        embedding=parts[0],
        deepstack=parts[1:],
        expires_at=time.time() + expires_in,
        uuid=uuid,
    )
    return encode_embedding_message(message)


def tensor_files(store: EmbeddingStore) -> list:
    """The files the store keeps (its lock file aside), temporary ones included."""
    return sorted(p for p in store.dir.iterdir() if not p.name.startswith("."))


class Peer:
    """One DEALER connection: what it sends arrives in order (a release before the holds query after it)."""

    def __init__(self, store: EmbeddingStore) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(store.endpoint)

    def send(self, message: list, wait_ms: int = REPLY_MS):
        self.sock.send_multipart(message)
        return decode_reply(self.sock.recv()) if self.sock.poll(wait_ms) else None

    def release(self, request_id: str, uuids: list[str]) -> None:
        """Sent, and taken: the holds query after it on the same connection is answered."""
        self.sock.send(encode_release(request_id, uuids))
        assert isinstance(self.send([encode_holds([], "sync")]), Held)

    def close(self) -> None:
        self.sock.close(0)


def send(store: EmbeddingStore, message: list, key: bytes | None = None, wait_ms: int = REPLY_MS):
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.linger = 0
        if key is not None:
            wirekey.configure_client(sock, key)
        sock.connect(store.endpoint)
        sock.send_multipart(message)
        return decode_reply(sock.recv()) if sock.poll(wait_ms) else None


def test_a_message_is_kept_whole_as_main_and_deepstack_side_by_side(store):
    message = frames("a" * 64)
    assert isinstance(send(store, message), Ack)
    entry = store.get("a" * 64)
    assert (entry.rows, entry.width, entry.dtype) == (12, WIDTH, "float32")
    from vitserve.rpc.wire import decode_embedding_message

    sent = decode_embedding_message([bytes(f) for f in message])
    expected = torch.cat([sent.embedding, *sent.deepstack], dim=-1)
    where = as_dict(entry)
    assert torch.equal(read_entry(where["path"], where["dtype"], where["rows"], where["width"]), expected)
    assert store.counters()["received"] == 1
    assert store.counters()["held_bytes"] == 12 * WIDTH * 4


def test_a_bfloat16_message_stays_bfloat16(store):
    assert isinstance(send(store, frames("b" * 64, dtype=torch.bfloat16)), Ack)
    where = as_dict(store.get("b" * 64))
    assert read_entry(where["path"], where["dtype"], where["rows"], where["width"]).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"rows": 5}, "rows"),
        ({"grid": (1, 6, 6)}, "rows"),
        ({"uuid": None}, "uuid"),
        ({"expires_in": -1.0}, "expired"),
    ],
)
def test_what_cannot_be_kept_is_refused_and_nothing_of_it_stays(store, over, why):
    uuid = over.pop("uuid", "c" * 64)
    reply = send(store, frames(uuid, **over))
    assert isinstance(reply, Nack)
    assert why in reply.reason
    assert store.counters()["held"] == 0
    assert tensor_files(store) == []


def test_a_wrong_width_is_refused(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10**6, Shape(16, 2), directory=str(tmp_path))
    ) as s:
        reply = send(s, frames("d" * 64))
        assert isinstance(reply, Nack)
        assert "width 24" in reply.reason


def test_the_bound_evicts_only_spent_entries_oldest_first_and_refuses_beside_the_rest(store):
    for i in range(4):
        assert isinstance(send(store, frames(f"{i}" * 64)), Ack)
    # Acknowledged and not loaded yet: their requests may be on the way, so a new arrival does not push them out.
    reply = send(store, frames("4" * 64))
    assert isinstance(reply, Nack)
    assert "acknowledged and not yet loaded" in reply.reason
    assert all(store.get(f"{i}" * 64) is not None for i in range(4))
    for uuid in ("0", "1"):  # two requests load and finish: their entries are spent
        store.pin(uuid * 64, f"req-{uuid}")
        store.unpin({uuid * 64}, f"req-{uuid}")
    store.pin("0" * 64, "req-again")  # a third request names "0" again: pinned, never evicted
    assert isinstance(send(store, frames("4" * 64)), Ack)  # evicts "1", the oldest spent unpinned one
    assert store.get("0" * 64) is not None
    assert store.get("1" * 64) is None
    assert store.counters()["evicted"] == 1
    reply = send(store, frames("6" * 64, rows=60, grid=(1, 10, 24)))
    assert isinstance(reply, Nack)
    assert reply.reason.startswith("too_large: ")  # the reason's code comes first (checks.REASONS)
    assert store.counters()["held_bytes"] <= store.max_bytes


def test_a_holds_query_makes_a_spent_entry_kept_again(store):
    for i in range(4):
        assert isinstance(send(store, frames(f"{i}" * 64)), Ack)
    store.pin("0" * 64, "req-0")
    store.unpin({"0" * 64}, "req-0")
    assert send(store, [encode_holds(["0" * 64], "q-1")]) == Held("q-1", ("0" * 64,))
    reply = send(store, frames("4" * 64))  # nothing is spent any more
    assert isinstance(reply, Nack)
    assert store.get("0" * 64) is not None


def test_holds_queries_answer_what_is_held_and_keep_it(store):
    assert isinstance(send(store, frames("e" * 64, expires_in=0.5)), Ack)
    until = time.time() + 60
    assert send(store, [encode_holds(["e" * 64, "f" * 64], "q", expires_at=until)]) == Held("q", ("e" * 64,))
    assert store.get("e" * 64).expires_at >= until


def test_an_unpinned_entry_goes_at_its_expiry_and_a_pinned_one_stays(store):
    assert isinstance(send(store, frames("1" * 64, expires_in=0.3)), Ack)
    assert isinstance(send(store, frames("2" * 64, expires_in=0.3)), Ack)
    store.pin("2" * 64, "req")
    while store.get("1" * 64) is not None:  # the receiver thread sweeps every 0.2 s
        time.sleep(0.05)
    assert store.counters()["expired"] == 1
    assert store.get("2" * 64) is not None


def test_garbage_is_counted_and_unanswered(store):
    assert send(store, [b"\xc1garbage"], wait_ms=1000) is None
    assert store.counters()["rejected"] == 1
    assert isinstance(send(store, frames("7" * 64)), Ack)  # and the next message is taken


def test_with_a_key_a_stranger_is_never_read(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10**6, Shape(WIDTH, 2), key=SECRET, directory=str(tmp_path))
    ) as s:
        assert send(s, frames("8" * 64), key=None, wait_ms=1000) is None
        assert send(s, frames("8" * 64), key=b"x" * 32, wait_ms=1000) is None
        assert s.counters() == {**s.counters(), "received": 0, "rejected": 0, "held": 0}
        while s.counters()["handshakes_failed"] < 2:  # counted (and logged) by the receiver thread
            time.sleep(0.05)
        assert isinstance(send(s, frames("9" * 64), key=SECRET), Ack)


def test_a_taken_endpoint_is_an_oserror(store, tmp_path):
    with pytest.raises(OSError, match="cannot bind"):
        EmbeddingStore(store.endpoint, 10, Shape(0, 2), directory=str(tmp_path))


def test_a_directory_whose_lock_is_free_is_removed_and_a_live_stores_is_not(tmp_path):
    dead = (
        tmp_path / f"vitserve-ec-{os.getpid()}-abc"
    )  # a killed vLLM's: its lock file is there, nobody holds it
    (dead / "x.tmp").mkdir(parents=True)
    (dead / ".lock").touch()
    starting = tmp_path / ".vitserve-ec-new-1-abc"  # a store between mkdtemp and its lock: left alone
    starting.mkdir()
    crashed = tmp_path / ".vitserve-ec-new-2-abc"  # one whose start died there a while ago: removed
    crashed.mkdir()
    os.utime(crashed, (time.time() - 3600, time.time() - 3600))
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10, Shape(0, 2), directory=str(tmp_path))
    ) as live:  # a live store's directory, whatever the pid in its name says
        with contextlib.closing(
            EmbeddingStore("tcp://127.0.0.1:*", 10, Shape(0, 2), directory=str(tmp_path))
        ) as second:
            assert not dead.exists()
            assert not crashed.exists()
            assert starting.is_dir()
            assert live.dir.is_dir()
            assert second.dir != live.dir
        assert not second.dir.exists()
        assert live.dir.is_dir()
    assert not live.dir.exists()


def test_a_release_makes_a_failed_requests_entries_evictable_at_once(store):
    peer = Peer(store)
    for i in range(4):
        assert isinstance(peer.send(frames(f"{i}" * 64, request_id=f"req-{i}")), Ack)
    assert isinstance(peer.send(frames("4" * 64)), Nack)  # all four are claimed by their pushes
    peer.release("req-9", ["0" * 64])  # another request's release changes nothing
    assert isinstance(peer.send(frames("4" * 64)), Nack)
    peer.release("req-0", ["0" * 64, "f" * 64])  # an unknown uuid in a release is ignored
    assert isinstance(peer.send(frames("4" * 64)), Ack)  # "0" was spent: evicted
    assert store.get("0" * 64) is None
    assert store.counters()["releases"] == 2
    peer.close()


def test_a_holds_promise_survives_a_load_until_its_time(store):
    peer = Peer(store)
    for i in range(4):
        assert isinstance(peer.send(frames(f"{i}" * 64)), Ack)
    assert peer.send([encode_holds(["0" * 64], "q", expires_at=time.time() + 60)]) == Held("q", ("0" * 64,))
    store.pin("0" * 64, "vllm-1")  # a request loads it (it was promised to another one too)
    store.unpin({"0" * 64}, "vllm-1")
    reply = peer.send(frames("4" * 64))
    assert isinstance(reply, Nack)
    assert reply.reason.startswith("full: ")
    assert store.get("0" * 64) is not None
    peer.close()


def test_expiry_and_holds_are_capped_at_max_hold_s(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10**6, Shape(WIDTH, 2), directory=str(tmp_path), max_hold_s=5)
    ) as s:
        assert isinstance(send(s, frames("a" * 64, expires_in=3600)), Ack)
        assert s.get("a" * 64).expires_at <= time.time() + 5
        held = send(s, [encode_holds(["a" * 64], "q", expires_at=time.time() + 3600)])
        assert held == Held("q", ("a" * 64,))
        entry = s.get("a" * 64)
        assert entry.expires_at <= time.time() + 5
        assert entry.promised_until <= time.time() + 5


def test_a_keyless_connector_refuses_a_network_endpoint_unless_allowed(tmp_path, caplog):
    with pytest.raises(ValueError, match="key_file") as refused:
        EmbeddingStore("tcp://0.0.0.0:*", 10**6, Shape(WIDTH, 2), directory=str(tmp_path))
    message = str(refused.value)
    assert "tcp://0.0.0.0:*" in message
    assert "--wire_key_file" in message
    assert '"allow_unauthenticated": true' in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
    with (
        caplog.at_level(logging.WARNING),
        contextlib.closing(
            EmbeddingStore(
                "tcp://0.0.0.0:*", 10**6, Shape(WIDTH, 2), directory=str(tmp_path), allow_unauthenticated=True
            )
        ),
    ):
        pass
    assert any("WITHOUT a key" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with contextlib.closing(
        EmbeddingStore("tcp://0.0.0.0:*", 10**6, Shape(WIDTH, 2), key=SECRET, directory=str(tmp_path))
    ):
        pass


def test_a_bound_above_the_devices_free_space_is_lowered_with_a_warning(tmp_path, caplog):
    with (
        caplog.at_level(logging.WARNING),
        contextlib.closing(
            EmbeddingStore("tcp://127.0.0.1:*", 2**62, Shape(WIDTH, 2), directory=str(tmp_path))
        ) as s,
    ):
        assert s.max_bytes < 2**62
        assert s.counters()["max_bytes"] == s.max_bytes
    warning = next(r.getMessage() for r in caplog.records if "free" in r.getMessage())
    assert str(2**62) in warning
    assert "--shm-size" in warning


@pytest.mark.parametrize("error", [RuntimeError("a bug"), zmq.ZMQError(zmq.ETERM)], ids=["bug", "zmq"])
def test_a_receiver_that_fails_is_restarted_and_says_so(store, error):
    before = time.monotonic()
    assert store.failure_since(before) is None
    sweep = store._sweep

    def fail_once():
        store._sweep = sweep
        raise error

    store._sweep = fail_once  # the loop's own step fails (not a message): the supervisor starts it again
    while store.counters()["receiver_restarts"] == 0:
        time.sleep(0.02)
    assert type(error).__name__ in store.failure_since(before)
    assert store.failure_since(time.monotonic()) is None
    assert isinstance(
        send(store, frames("a" * 64)), Ack
    )  # a fresh socket on the same endpoint when ZMQ failed


def test_another_shape_under_a_pinned_uuid_is_a_conflict_and_an_unpinned_one_is_replaced(store):
    assert isinstance(send(store, frames("a" * 64)), Ack)
    store.pin("a" * 64, "vllm-1")
    reply = send(store, frames("a" * 64, rows=24, grid=(1, 6, 16)))
    assert isinstance(reply, Nack)
    assert reply.reason.startswith("conflict: ")
    assert store.get("a" * 64).rows == 12
    store.unpin({"a" * 64}, "vllm-1")
    assert isinstance(send(store, frames("a" * 64, rows=24, grid=(1, 6, 16))), Ack)
    assert store.get("a" * 64).rows == 24
    assert store.counters()["held_bytes"] == 24 * WIDTH * 4
    assert [p.stat().st_size for p in tensor_files(store)] == [24 * WIDTH * 4]


def test_a_loaded_tensor_keeps_nothing_of_its_file_mapped(tmp_path):
    """The worker's load is a copy of its own: once the connector deletes the file, no mapping of it stays in
    the process (a copy-on-write map would keep the shared-memory pages alive in vLLM's encoder cache)."""
    expected = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)
    path = tmp_path / "held"
    path.write_bytes(expected.numpy().tobytes())
    loaded = read_entry(str(path), "float32", 12, 8)
    path.unlink()
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    assert torch.equal(loaded, expected)
    path.write_bytes(expected[:6].numpy().tobytes())
    with pytest.raises(ValueError, match="holds 192 bytes, 384 expected"):
        read_entry(str(path), "float32", 12, 8)
