"""Recycled pages (vitserve/connector/pool.py): the files of entries the connector let go are kept, a few, and
vitserve's next same-host write claims one and overwrites it. Real ZMQ on loopback, a real LLMSender, real files
and flocks, writers in real threads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_connector_handoff import incoming, message, send_file
from tests.unit.test_connector_hostile import big, tmpfs  # noqa: F401  # the 1 MiB tmpfs fixture
from tests.unit.test_connector_store import WIDTH, Peer
from vitserve.connector.files import _still_held
from vitserve.connector.pool import POOL, POOL_FILES, Pool, claim
from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.handover.same_host import SameHost, write_file
from vitserve.rpc.replies import Ack
from vitserve.rpc.sender import LLMSender

ONE = 12 * WIDTH * 2  # one message(uuid) in bfloat16: 12 rows


@pytest.fixture
def store(tmp_path):
    """A bound of one embedding: each arrival evicts the one before once it is loaded (spent)."""
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", ONE + 100, Shape(WIDTH, 2), directory=str(tmp_path), dtype="bfloat16")
    ) as s:  # fmt: skip
        yield s


def pool_of(store: EmbeddingStore) -> Path:
    return store.dir / POOL


def loaded(store: EmbeddingStore, uuid: str) -> torch.Tensor:
    """What vLLM's worker reads, then the request finished (the entry is spent)."""
    w = as_dict(store.get(uuid))
    tensor = read_entry(w["path"], w["dtype"], w["rows"], w["width"])
    store.pin(uuid, "vllm")
    store.unpin({uuid}, "vllm")
    return tensor


def expected(m) -> torch.Tensor:
    return torch.cat([m.embedding, *m.deepstack], dim=-1).to(torch.bfloat16)


def test_a_spent_file_is_pooled_and_the_next_write_reuses_it_with_the_right_contents(store):
    with LLMSender(store.endpoint) as sender:
        assert sender.wait_reachable(30)
        same = SameHost(sender)
        assert same.dtype(torch.float32) == torch.bfloat16
        sent = {}
        for uuid, rows in (("a" * 64, 12), ("b" * 64, 12), ("c" * 64, 12), ("d" * 64, 8)):
            sent[uuid] = message(uuid, rows)
            same.send(sent[uuid], time.monotonic() + 30, torch.bfloat16).wait(30)
            assert torch.equal(loaded(store, uuid), expected(sent[uuid])), uuid
    assert same.files == 4
    # b evicted a into the pool and c took it; c evicted b, and d took it (shorter: truncated)
    assert same.recycled == 2
    counters = store.counters()
    assert (counters["evicted"], counters["pooled"], counters["adopted"]) == (3, 3, 4)
    assert (counters["pool_files"], counters["pool_bytes"]) == (1, ONE)  # c's file, evicted by d
    assert list(incoming(store).iterdir()) == []


def test_two_writers_never_claim_the_same_file(tmp_path):
    area, pool = tmp_path / ".incoming", tmp_path / POOL
    area.mkdir()
    pool.mkdir()
    for round_ in range(20):
        for i in range(3):
            (pool / f"p-{round_:016x}{i:016x}").write_bytes(b"\0" * 64)
        barrier, got = threading.Barrier(6), []

        def writer(barrier=barrier, got=got) -> None:
            barrier.wait()
            claimed = claim(area, 64)
            if claimed is not None:
                got.append(claimed[0])
                os.close(claimed[1])

        threads = [threading.Thread(target=writer) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 3, round_  # each pool file claimed once, three writers went fresh
        assert len(set(got)) == 3, round_
        assert list(pool.iterdir()) == []
        for name in got:
            (area / name).unlink()


def test_the_pool_keeps_at_most_its_files_and_bytes_and_deletes_the_rest(tmp_path):
    pool = Pool(tmp_path, max_bytes=10 << 20)
    files = [tmp_path / f"{i:064x}" for i in range(POOL_FILES + 2)]
    for f in files:
        f.write_bytes(b"\0" * 1024)
    pool.take(files)
    assert pool.counters() == {
        "pooled": POOL_FILES,
        "pool_files": POOL_FILES,
        "pool_bytes": POOL_FILES * 1024,
    }
    assert not any(f.exists() for f in files)  # the two that did not fit are deleted
    pool.drain()
    assert pool.counters()["pool_files"] == 0
    (tmp_path / "small").mkdir()
    small = Pool(tmp_path / "small", max_bytes=1500)
    two = [tmp_path / "x", tmp_path / "y"]
    for f in two:
        f.write_bytes(b"\0" * 1024)
    small.take(two)
    assert small.counters()["pool_bytes"] == 1024  # the bytes bound (never more than max_bytes)


def test_a_file_a_worker_still_reads_is_never_written(store):
    """A load that raced its release: the worker holds the shared flock; vitserve's claim skips and deletes it."""
    m = message("a" * 64)
    f = write_file(incoming(store), m, torch.bfloat16, time.time() + 60)
    assert isinstance(send_file(store, f), Ack)
    path = store.get("a" * 64).path
    with open(path, "rb") as reader:
        fcntl.flock(reader.fileno(), fcntl.LOCK_SH)
        store.pin("a" * 64, "vllm")
        store.unpin({"a" * 64}, "vllm")
        b = write_file(incoming(store), message("b" * 64), torch.bfloat16, time.time() + 60)
        assert isinstance(send_file(store, b), Ack)
        assert store.counters()["pool_files"] == 1  # a, evicted into the pool while it is read
        other = write_file(incoming(store), message("c" * 64), torch.bfloat16, time.time() + 60)
        assert not other.recycled  # the claim found the reader's lock: a fresh file instead
        assert store.counters()["pool_files"] == 0
        assert reader.read() == expected(m).view(torch.uint8).numpy().tobytes()  # untouched


def test_a_worker_that_opened_a_file_before_it_was_let_go_finds_it_gone(store):
    """read_entry's check once it holds its lock (files._still_held), for a worker that opened the file just before
    the connector let it go and vitserve claimed it."""
    f = write_file(incoming(store), message("a" * 64), torch.bfloat16, time.time() + 60)
    assert isinstance(send_file(store, f), Ack)
    w = as_dict(store.get("a" * 64))
    fd = os.open(w["path"], os.O_RDONLY)  # opened; then the entry goes to the pool and vitserve claims it
    try:
        store.pin("a" * 64, "vllm")
        store.unpin({"a" * 64}, "vllm")
        b = write_file(incoming(store), message("b" * 64), torch.bfloat16, time.time() + 60)
        assert isinstance(send_file(store, b), Ack)
        claimed = claim(incoming(store), ONE)
        assert claimed is not None
        with pytest.raises(FileNotFoundError, match="let this file go"):
            _still_held(fd, w["path"])  # vitserve holds its exclusive lock
        os.close(claimed[1])  # written and announced: its lock is gone, and the path names nothing
        with pytest.raises(FileNotFoundError, match="let this file go"):
            _still_held(fd, w["path"])
    finally:
        os.close(fd)


def test_a_planted_link_in_the_pool_is_never_written_through(store, tmp_path):
    """vitserve opens what it claimed without following a link, and deletes what is not a plain file."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"\1" * ONE)
    pool_of(store).joinpath("p-" + "0" * 32).symlink_to(outside)
    assert claim(incoming(store), ONE) is None
    assert outside.read_bytes() == b"\1" * ONE
    assert list(incoming(store).iterdir()) == []
    assert list(pool_of(store).iterdir()) == []


def test_the_workers_buffer_is_reused_only_once_its_tensor_is_gone(tmp_path):
    """read_entry's huge-page buffers (files._Buffers): a tensor vLLM still holds is never read into."""
    rows, width = 2048, 1024  # 4 MiB of float16: a buffer of its own
    first, second = tmp_path / "1", tmp_path / "2"
    a = torch.randn(rows, width).to(torch.float16)
    b = torch.randn(rows, width).to(torch.float16)
    first.write_bytes(a.view(torch.uint8).numpy().tobytes())
    second.write_bytes(b.view(torch.uint8).numpy().tobytes())
    whole = read_entry(str(first), "float16", rows, width)
    held, base = whole[1:], whole.data_ptr()  # a view alone keeps the buffer busy
    del whole
    other = read_entry(str(second), "float16", rows, width)
    assert other.data_ptr() != base  # another buffer
    assert torch.equal(held, a[1:])
    assert torch.equal(other, b)
    ptr = other.data_ptr()
    del other
    again = read_entry(str(first), "float16", rows, width)
    assert again.data_ptr() == ptr  # the buffer whose tensor is gone, reused
    assert torch.equal(again, a)
    assert torch.equal(held, a[1:])


def test_a_full_device_empties_the_pool_before_it_refuses(tmpfs):  # noqa: F811
    """On a 1 MiB tmpfs: the pool's pages are the first room a write that meets ENOSPC gets back."""
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10 << 20, Shape(WIDTH, 2), directory=str(tmpfs))
    ) as s:
        peer = Peer(s)
        for uuid in ("a" * 64, "b" * 64):
            assert isinstance(peer.send(big(uuid)), Ack)
            s.pin(uuid, "vllm")
            s.unpin({uuid}, "vllm")  # loaded: spent
        reply = peer.send(big("c" * 64))  # a goes to the pool, and its pages leave no room for c
        assert isinstance(reply, Ack), reply
        counters = s.counters()
        assert counters["refused"] == 0
        assert (counters["pooled"], counters["pool_files"], counters["pool_bytes"]) == (2, 0, 0)
        assert s.get("c" * 64) is not None
        peer.close()
