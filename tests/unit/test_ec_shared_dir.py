"""Two EcStores on one directory, as two vitserve replicas sharing one --ec_storage_path
(handover/ec_store.py, handover/ec_pins.py): pins one takes hold against the other's eviction and start-up
clean-up, either reuses the other's files, and the byte bound counts the directory's files, whoever wrote
them. Their locks are `flock`s on separate open files, which conflict within one process as between two
(tests/integration/test_ec_replicas.py runs two real processes)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vitserve.handover.ec_files import FILE_NAME, ec_uuid, file_path
from vitserve.handover.ec_pins import PINS_DIR, DirPins
from vitserve.handover.ec_store import EcStore
from vitserve.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001  # every write and use later than the one before
        return self.now


def _store(root: Path, clock: Clock, max_bytes: int = 1 << 30) -> EcStore:
    # rescan_s=0: every write sees the other store's latest files (by default a scan is at most 1 s old)
    kw = {"sweep_every_s": 0.0, "rescan_s": 0.0}
    return EcStore(root, ttl_s=60.0, max_bytes=max_bytes, metrics=Metrics(), clock=clock, **kw)


def _write(store: EcStore, name: str, keep_pinned: bool = False) -> str:
    uuid = ec_uuid("fp", "image", name)
    store.pin(uuid)
    store.put(uuid, torch.zeros(4, 8, dtype=torch.bfloat16), {"grid": "[1, 4, 4]"})
    if not keep_pinned:
        store.unpin([uuid])
    return uuid


def _size(tmp_path: Path) -> int:
    probe = _store(tmp_path / "probe", Clock())
    return file_path(probe.root, _write(probe, "probe")).stat().st_size


def test_a_file_the_other_replica_pins_outlives_this_ones_byte_bound_and_ttl(tmp_path):
    clock = Clock()
    size = _size(tmp_path)
    one, two = _store(tmp_path / "ec", clock), _store(tmp_path / "ec", clock, max_bytes=2 * size)
    held = _write(one, "held", keep_pinned=True)  # written by one, its request still in flight
    others = [_write(two, name) for name in "abc"]
    assert file_path(one.root, held).is_file()
    assert two.uuids() == [held, others[2]]  # the bound held for the whole directory; held was skipped
    assert two.bytes == 2 * size
    clock.now += 61
    two.maintain()
    assert two.uuids() == [held]  # past its TTL too, and still pinned
    one.unpin([held])
    clock.now += 61
    two.maintain()
    assert two.uuids() == []
    assert os.listdir(one.root) == [PINS_DIR]
    assert os.listdir(one.root / PINS_DIR) == []  # every lock file went with its file


def test_a_replica_reuses_the_others_file_and_keeps_it_pinned(tmp_path):
    clock = Clock()
    size = _size(tmp_path)
    one, two = _store(tmp_path / "ec", clock, max_bytes=size), _store(tmp_path / "ec", clock, max_bytes=size)
    uuid = _write(one, "shared")
    entry = two.lookup(uuid)  # a reuse, no write
    assert entry is not None
    assert entry.info.metadata["grid"] == "[1, 4, 4]"
    assert two.metrics.value("vitserve_ec_reuses_total") == 1
    _write(one, "next")  # one is over the bound: the file two pins stays, its own goes
    assert file_path(one.root, uuid).is_file()
    two.unpin([uuid])
    _write(one, "last")
    assert not file_path(one.root, uuid).exists()
    assert one.lookup(uuid) is None  # gone for both; a lookup pins nothing then
    one.maintain()  # the lock file that lookup left goes with the upkeep
    assert os.listdir(one.root / PINS_DIR) == [ec_uuid("fp", "image", "last")]


def test_start_up_leaves_a_live_writers_temporary_file_alone(tmp_path):
    clock = Clock()
    one = _store(tmp_path / "ec", clock)
    uuid = ec_uuid("fp", "image", "being written")
    one.pin(uuid)
    temp = one.root / uuid / ".vitserve-abc"
    temp.parent.mkdir()
    temp.write_bytes(b"half")  # one is writing it
    _store(tmp_path / "ec", clock)  # another replica starts
    assert temp.exists()
    one.unpin([uuid])
    _store(tmp_path / "ec", clock)  # nobody writes it now: a leftover
    assert not temp.exists()


def test_a_lock_is_taken_afresh_when_a_removal_took_the_file_it_waited_on(tmp_path):
    pins = DirPins(tmp_path)
    uuid = ec_uuid("fp", "image", "x")
    fd = pins.hold(uuid)
    assert not pins.remove_if_free(uuid, lambda: None)  # pinned: nothing is done
    os.close(fd)
    assert pins.remove_if_free(uuid, lambda: None)
    assert pins.names() == []
    fd = pins.hold(uuid)  # a new lock file
    try:
        assert pins.names() == [uuid]
        assert os.fstat(fd).st_ino == os.stat(tmp_path / PINS_DIR / uuid).st_ino
    finally:
        os.close(fd)
    assert (tmp_path / PINS_DIR / uuid).exists()
    assert not (tmp_path / uuid / FILE_NAME).exists()
