"""The connector's store against what a peer may send and a full device (issue 48): real ZMQ on loopback, real files,
a real small tmpfs where the test may mount one. After every message the receiver still answers, the byte total is
the bytes of the files on disk, and no temporary file is left."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import tempfile
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tests.unit.test_connector_store import WIDTH, Peer, frames
from vitserve.connector.files import TEMP_SUFFIX, file_name
from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.rpc.replies import Ack, Held, Nack, encode_holds, encode_release

ROW_BYTES = WIDTH * 4  # float32


def hostile(uuid: str = "a" * 64, **header) -> list:
    """A normal message whose header fields are replaced after encoding (what a raw peer can send)."""
    message = frames(uuid if uuid.isascii() and "/" not in uuid and ".." not in uuid else "a" * 64)
    fields = {**msgpack.unpackb(message[0]), "uuid": uuid, **header}
    return [msgpack.packb(fields), *message[1:]]


def zero_rows() -> list:
    header = {**msgpack.unpackb(frames("z" * 64)[0]), "grid_thw": [1, 0, 0], "num_tokens": 0, "shape": [0, 8]}
    header["deepstack_shapes"] = [[0, 8], [0, 8]]
    return [msgpack.packb(header), b"", b"", b""]


def zero_width() -> list:
    header = {**msgpack.unpackb(frames("w" * 64)[0]), "shape": [12, 0], "deepstack_shapes": []}
    return [msgpack.packb(header), b""]


def on_disk(store: EmbeddingStore) -> tuple[int, int, list[str]]:
    """(bytes of the tensor files, their count, temporary files)."""
    files = [p for p in store.dir.iterdir() if not p.name.startswith(".")]
    temp = [p.name for p in files if p.name.endswith(TEMP_SUFFIX)]
    return sum(p.stat().st_size for p in files if p.name not in temp), len(files) - len(temp), temp


def assert_consistent(store: EmbeddingStore) -> None:
    counters = store.counters()
    assert on_disk(store) == (counters["held_bytes"], counters["held"], [])
    assert counters["held_bytes"] <= store.max_bytes


@pytest.fixture
def store(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 4 * 12 * ROW_BYTES, Shape(WIDTH, 2), directory=str(tmp_path))
    ) as s:
        yield s


@pytest.mark.parametrize(
    ("message", "answer"),
    [
        (zero_rows(), "shape: zero rows"),
        (hostile("."), None),
        (hostile("-"), None),
        (hostile(":" * 3), None),
        (hostile("u" * 246), None),  # "<uuid>.<id>.tmp" passed 255 bytes before names were digests
        (hostile("u" * 250), None),
        (hostile("u" * 256), None),
        (hostile("b" * 64, message_id="../../x/y"), None),
        (hostile("b" * 64, message_id="m/" * 100), None),
        (hostile("a/b"), None),  # any string vLLM takes: the file's name is the uuid's digest
        (hostile(".."), None),
        (hostile("é日本"), None),
        (hostile("c" * 64, message_id=""), None),  # no message id to name: rejected unanswered
    ],
    ids=lambda x: str(x)[:24] if isinstance(x, str) else None,
)
def test_a_hostile_well_formed_message_is_answered_and_the_next_one_taken(store, message, answer):
    # made when the module was collected, maybe minutes ago in a full run: fresh again, or it is refused expired
    message = [msgpack.packb({**msgpack.unpackb(message[0]), "expires_at": time.time() + 60}), *message[1:]]
    peer = Peer(store)
    uuid = msgpack.unpackb(message[0])["uuid"]
    reply = peer.send(message, wait_ms=1000 if msgpack.unpackb(message[0])["message_id"] == "" else 30_000)
    if msgpack.unpackb(message[0])["message_id"] == "":
        assert reply is None
        assert store.counters()["rejected"] == 1
    elif answer is None:
        assert isinstance(reply, Ack)
        entry = store.get(uuid)
        assert entry.path.parent == store.dir
        assert entry.path.name == file_name(uuid)  # 64 hex characters, whatever the uuid
        where = as_dict(entry)
        assert read_entry(where["path"], where["dtype"], where["rows"], where["width"]).shape == (12, WIDTH)
    else:
        assert isinstance(reply, Nack)
        assert reply.reason.startswith(answer)
        assert store.get(uuid) is None
    assert isinstance(peer.send(frames("9" * 64)), Ack)  # the receiver is alive
    assert store.counters()["receiver_restarts"] == 0
    assert_consistent(store)
    peer.close()


def test_zero_columns_are_refused_also_where_the_width_is_not_checked(tmp_path):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10**6, Shape(0, 2), directory=str(tmp_path))
    ) as s:
        peer = Peer(s)
        reply = peer.send(zero_width())
        assert isinstance(reply, Nack)
        assert reply.reason.startswith("shape: zero columns")
        assert isinstance(peer.send(frames("9" * 64)), Ack)
        assert_consistent(s)
        peer.close()


@pytest.mark.parametrize(
    ("error", "answer"),
    [(ValueError("a bug"), "internal: ValueError: a bug"), (PermissionError(13, "denied"), "write_failed: ")],
)
def test_a_write_that_fails_is_a_nack_with_its_reason_and_the_next_one_is_kept(store, error, answer):
    write = store._dir.write

    def fail_once(*args):
        store._dir.write = write
        raise error

    store._dir.write = fail_once
    peer = Peer(store)
    reply = peer.send(frames("a" * 64))
    assert isinstance(reply, Nack)
    assert reply.reason.startswith(answer)
    assert isinstance(peer.send(frames("a" * 64)), Ack)
    counters = store.counters()
    assert counters["refused_" + answer.split(":")[0]] == 1
    assert counters["receiver_restarts"] == 0
    assert_consistent(store)
    peer.close()


def test_a_name_is_a_digest_whatever_the_uuid(tmp_path):
    from vitserve.connector.files import TensorDir

    tensors = TensorDir(tmp_path, _log())
    for uuid in ("a/b", "..", ".", "/etc/passwd", "é日本", "\udcff", "x" * 10_000):
        path = tensors.write(uuid, [torch.ones(2, 8)], 2)
        assert path.parent == tensors.path
        assert len(path.name) == 64
    tensors.close()
    assert list(tmp_path.iterdir()) == []


def _log():
    return logging.getLogger("test")


# ---------------------------------------------------------------------------------------- a real small device


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs (mount(2) through libc: a unit test starts no process); skipped where mounting is denied."""
    where = tmp_path / "shm"
    where.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", str(where).encode(), b"tmpfs", 0, b"size=1m") != 0:
        pytest.skip(
            f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())} (needs root or CAP_SYS_ADMIN)"
        )
    yield where
    libc.umount2(str(where).encode(), 2)  # MNT_DETACH


def big(uuid: str, rows: int = 4096, **kw) -> list:
    return frames(uuid, rows=rows, grid=(1, 2, 2 * rows), **kw)  # 4096 rows: 384 KiB


def test_a_full_device_is_a_device_full_nack_and_the_next_fitting_message_is_kept(tmpfs, caplog):
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10 << 20, Shape(WIDTH, 2), directory=str(tmpfs))
    ) as s:
        assert s.max_bytes <= 1 << 20  # lowered to the device's free space at start, with a warning
        assert any("--shm-size" in r.getMessage() for r in caplog.records)
        peer = Peer(s)
        filler = tmpfs / "another-users-file"
        filler.write_bytes(b"\0" * (700 << 10))  # the device fills behind the bound's back
        reply = peer.send(big("a" * 64))
        assert isinstance(reply, Nack)
        assert reply.reason.startswith("device_full: ")
        assert "--shm-size" in reply.reason
        assert s.counters()["refused_device_full"] == 1
        assert_consistent(s)
        filler.unlink()
        assert isinstance(peer.send(big("b" * 64)), Ack)
        # A spent entry is evicted on ENOSPC, and the write tried once more.
        s.pin("b" * 64, "vllm-1")
        s.unpin({"b" * 64}, "vllm-1")
        filler.write_bytes(b"\0" * (300 << 10))
        assert isinstance(peer.send(big("c" * 64)), Ack)
        assert s.get("b" * 64) is None
        assert s.counters()["evicted"] == 1
        assert_consistent(s)
        peer.close()


# ---------------------------------------------------------------------------------------- any sequence of messages

_UUIDS = st.sampled_from(["0" * 64, "1" * 64, "2" * 64, ".", "u" * 250])
_MESSAGES = st.one_of(
    st.builds(
        lambda u, r, e: ("push", frames(u, rows=12, expires_in=e, request_id=r)),
        _UUIDS,
        st.sampled_from("rst"),
        st.sampled_from([60.0, -1.0]),
    ),
    st.builds(
        lambda u: ("push", frames(u, rows=48, grid=(1, 12, 16))), _UUIDS
    ),  # the same uuid, another shape
    st.builds(lambda u: ("push", frames(u, rows=5)), _UUIDS),  # rows that disagree with the grid
    st.builds(lambda u: ("push", frames(u, rows=12 * 6, grid=(1, 12, 24))), _UUIDS),  # over the bound
    st.just(("push", zero_rows())),
    st.builds(lambda u: ("push", hostile(u)), st.sampled_from(["a/b", "..", "é"])),
    st.builds(
        lambda us: ("holds", [encode_holds(us, "q", expires_at=time.time() + 60)]),
        st.lists(_UUIDS, max_size=3),
    ),
    st.builds(
        lambda r, us: ("release", [encode_release(r, us)]),
        st.sampled_from("rst"),
        st.lists(_UUIDS, max_size=3),
    ),
    st.builds(lambda b: ("garbage", [b]), st.binary(max_size=64)),
    st.builds(lambda u: ("load", u), _UUIDS),
    st.builds(lambda u: ("pin", u), _UUIDS),
)


@settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_MESSAGES, min_size=1, max_size=25))
def test_any_sequence_leaves_the_receiver_answering_and_the_books_true(tmp_path, sequence):
    root = tempfile.mkdtemp(dir=tmp_path)
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 3 * 12 * ROW_BYTES, Shape(WIDTH, 2), directory=root)
    ) as s:
        peer = Peer(s)
        for kind, what in sequence:
            if kind == "push":
                assert isinstance(peer.send(what), Ack | Nack)
            elif kind == "holds":
                assert isinstance(peer.send(what), Held)
            elif kind in ("release", "garbage"):
                peer.sock.send_multipart(what)
            elif kind == "pin":
                s.pin(what, "vllm-pinned")
            else:
                s.pin(what, "vllm-load")
                s.unpin({what}, "vllm-load")
        assert isinstance(peer.send([encode_holds([], "sync")]), Held)  # everything before it was taken
        assert_consistent(s)
        s.unpin({"0" * 64, "1" * 64, "2" * 64, ".", "u" * 250}, "vllm-pinned")
        s.pin("n" * 64, "x")
        assert isinstance(peer.send(frames("n" * 64, rows=4, grid=(1, 4, 4))), Ack | Nack)
        assert s.counters()["receiver_restarts"] == 0
        assert s.counters()["refused"] == sum(v for k, v in s.counters().items() if k.startswith("refused_"))
        peer.close()


# ---------------------------------------------------------------------------------------- soak


@pytest.mark.slow
def test_a_soak_of_10000_messages_into_a_1_mb_bound(tmp_path):
    """Most pushes are loaded (then spent: evicted to make room) or released; one in ten is left to expire, so the
    bound is now and then full of claimed tensors and some arrivals are refused. Every message is answered."""
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 1 << 20, Shape(WIDTH, 2), directory=str(tmp_path))
    ) as s:
        peer = Peer(s)
        answers = {"ack": 0, "nack": 0}
        for i in range(10_000):
            uuid = f"{i % 700:064d}"
            reply = peer.send(
                big(uuid, rows=64 * (1 + i % 4), expires_in=0.2 + 0.1 * (i % 3), request_id=f"r{i}")
            )
            answers["ack" if isinstance(reply, Ack) else "nack"] += 1
            if i % 10 < 6:
                s.pin(uuid, f"v{i}")
                s.unpin({uuid}, f"v{i}")
            elif i % 10 < 9:
                peer.sock.send(encode_release(f"r{i}", [uuid]))
        assert answers["ack"] + answers["nack"] == 10_000
        assert answers["ack"] > 1_000
        time.sleep(1)  # the loop's claimed entries expire (loaded ones stay spent TOUCH_S, evictable)
        for i in range(8):  # and a last batch that stays, so the books are checked with something in them
            assert isinstance(peer.send(big(f"last-{i}", rows=64 * (1 + i % 4))), Ack)
        for _ in range(2):  # the sweep after the first sync's reply is done before the second is answered
            assert isinstance(peer.send([encode_holds([], "sync")]), Held)
        assert_consistent(s)
        counters = s.counters()
        assert counters["received"] == answers["ack"] + 8
        assert counters["refused"] == answers["nack"]
        assert all(s.get(f"last-{i}") is not None for i in range(8))
        assert counters["receiver_restarts"] == 0
        peer.close()


def test_a_flood_of_one_refusal_is_one_log_line(store, caplog):
    peer = Peer(store)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            assert isinstance(peer.send(zero_rows()), Nack)
    lines = [r for r in caplog.records if "refused message" in r.getMessage()]
    assert len(lines) <= 2  # one per 10 s (two if the flood straddles 10 s); the next says how many were not
    assert store.counters()["refused_shape"] == 50
    peer.close()
