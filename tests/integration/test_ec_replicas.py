"""Replicas sharing one --ec_storage_path (handover/ec_store.py, docs/vllm.md): two real processes, each with
its own EcStore on one directory under a tight byte bound, race lookups, writes, pins and evictions of the same
uuids. Each round is one request: its files are pinned (a reuse or a write), checked as vitserve checks them
before sending, read whole as vLLM reads them, then released. No file in flight may ever be missing, and the
directory as a whole keeps to its bound. A replica that dies holding pins holds nothing any more."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitserve.handover.ec_files import FILE_NAME, EcStorageError, ec_uuid, file_path
from vitserve.handover.ec_store import EcStore
from vitserve.metrics import Metrics

pytestmark = pytest.mark.timeout(180)

ROWS, WIDTH = 64, 64  # 8 KiB of bf16 a file
UUIDS = 12  # distinct images both replicas draw from: each is written, reused and evicted over and over
PER_REQUEST = 2
ROUNDS = 200  # main's per-process stores lost 64 and 100 files of 800 each at 400


def _tensor(n: int) -> torch.Tensor:
    return (torch.arange(ROWS * WIDTH, dtype=torch.float32).reshape(ROWS, WIDTH) + n).to(torch.bfloat16)


def _uuid(n: int) -> str:
    return ec_uuid("fp", "image", str(n))


def _store(root: Path, bound: int) -> EcStore:
    return EcStore(root, ttl_s=600.0, max_bytes=bound, metrics=Metrics(), sweep_every_s=0.0)


def _directory_bytes(root: Path) -> int:
    total = 0
    for path in root.glob(f"*/{FILE_NAME}"):
        with contextlib.suppress(FileNotFoundError):  # removed since the listing
            total += path.stat().st_size
    return total


def _request(store: EcStore, root: Path, names: list[int]) -> int:
    """One request's life; the number of its files that were not there while it was in flight (all of them
    when vitserve would have answered an error: a write that failed, or its check before sending)."""
    uuids = [_uuid(n) for n in names]
    pinned: list[str] = []
    lost = 0
    try:
        for n, uuid in zip(names, uuids, strict=True):
            if store.lookup(uuid) is None:
                store.pin(uuid)
                pinned.append(uuid)
                store.put(uuid, _tensor(n), {"grid": "[1, 16, 16]"})
            else:
                pinned.append(uuid)
        try:
            store.check([(uuid, ROWS, WIDTH) for uuid in uuids])  # what vitserve does before sending
            store.maintain()
        except EcStorageError:
            return len(uuids)
        for n, uuid in zip(names, uuids, strict=True):  # what vLLM does with the request
            try:
                loaded = load_file(str(file_path(root, uuid)))["ec_cache"]
            except FileNotFoundError:
                lost += 1
                continue
            assert torch.equal(loaded, _tensor(n))
    except EcStorageError:  # the write failed: an error answer
        return len(uuids)
    finally:
        store.unpin(pinned)
    return lost


def _replica(root: str, bound: int, seed: int, start, done, out) -> None:
    """One replica's loop, in its own process: (files lost in flight, the directory's bytes once both
    replicas are done and have run their upkeep)."""
    try:
        store = _store(Path(root), bound)
        rng = random.Random(seed)
        start.wait(60)
        lost = 0
        for _ in range(ROUNDS):
            lost += _request(store, Path(root), rng.sample(range(UUIDS), PER_REQUEST))
        done.wait(120)
        store.maintain()  # the periodic upkeep, here with nothing in flight anywhere
        done.wait(120)
        out.put((lost, _directory_bytes(Path(root))))
    except BaseException as exc:  # the test fails with it instead of waiting for a result
        out.put((repr(exc), 0))
        raise


def _file_bytes(root: Path) -> int:
    probe = root / "probe"
    store = _store(probe, 1 << 30)
    store.pin(_uuid(0))
    info = store.put(_uuid(0), _tensor(0), {"grid": "[1, 16, 16]"}).info
    store.unpin([_uuid(0)])
    return info.size


def test_two_replicas_never_remove_a_file_the_other_has_in_flight_and_keep_the_bound(tmp_path):
    size = _file_bytes(tmp_path)
    bound = 5 * size  # 12 images, 2 per request, 2 replicas: at most 4 pinned, so the bound is always at work
    root = tmp_path / "ec"
    root.mkdir()
    ctx = multiprocessing.get_context("spawn")
    start, done, out = ctx.Barrier(3), ctx.Barrier(2), ctx.Queue()
    args = (str(root), bound)
    replicas = [ctx.Process(target=_replica, args=(*args, seed, start, done, out)) for seed in (1, 2)]
    for p in replicas:
        p.start()
    try:
        start.wait(120)
        results = [out.get(timeout=150) for _ in replicas]
    finally:
        for p in replicas:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [lost for lost, _ in results] == [0, 0], results
    # the bound is the directory's: each replica's upkeep counts the other's files (main's stores, each
    # counting only its own, left up to twice the bound)
    assert [rest <= bound for _, rest in results] == [True, True], (results, bound)


def _holder(root: str, conn) -> None:
    """Pin a file, say so, and wait to be killed (never releasing it)."""
    store = _store(Path(root), 1 << 30)
    uuid = _uuid(99)
    store.pin(uuid)
    store.put(uuid, _tensor(99), {"grid": "[1, 16, 16]"})
    conn.send("pinned")
    conn.recv()  # never comes


def test_a_file_another_replica_pins_stays_until_that_replica_dies(tmp_path):
    size = _file_bytes(tmp_path)
    root = tmp_path / "ec"
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    holder = ctx.Process(target=_holder, args=(str(root), there))
    holder.start()
    try:
        assert here.poll(120)
        assert here.recv() == "pinned"
        pinned = file_path(root, _uuid(99))
        store = _store(root, 2 * size)
        for n in range(4):  # over the bound: everything unpinned goes, not the other replica's file
            store.pin(_uuid(n))
            store.put(_uuid(n), _tensor(n), {"grid": "[1, 16, 16]"})
            store.unpin([_uuid(n)])
        assert pinned.is_file()
        assert store.lookup(_uuid(99)) is not None  # a reuse of the other replica's file
        store.unpin([_uuid(99)])
    finally:
        holder.kill()
        holder.join(10)
    # the kernel let its lock go with the process: the file is evicted like any other, least recently used
    # first (its reuse above was before these writes)
    for n in (5, 6):
        store.pin(_uuid(n))
        store.put(_uuid(n), _tensor(n), {"grid": "[1, 16, 16]"})
        store.unpin([_uuid(n)])
    assert not pinned.exists()
    assert _directory_bytes(root) <= 2 * size
