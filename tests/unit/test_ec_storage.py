"""The encoder-cache files (--llm_transport ec_storage, docs/vllm.md): uuids, the atomic write, the header
check, and the directory's lifetime (pins, TTL, the byte bound, the sweep, start-up) on a real directory,
read back with the safetensors library vLLM loads them with. The clock is a variable the test moves."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitserve.api.ec_files import (
    FILE_NAME,
    EcFileMissing,
    EcStorageError,
    EcStorageFull,
    check_file,
    ec_uuid,
    file_path,
    is_uuid,
    write_file,
)
from vitserve.api.ec_store import EcStore
from vitserve.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tensor(rows: int, width: int = 8, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float32).reshape(rows, width).to(dtype)


def _store(root: Path, clock: Clock | None = None, **kw) -> tuple[EcStore, Metrics]:
    metrics = Metrics()
    kw = {"ttl_s": 60.0, "max_bytes": 1 << 30, **kw}
    store = EcStore(root, metrics=metrics, clock=clock or Clock(), sweep_every_s=0.0, **kw)
    return store, metrics


# ------------------------------------------------------------------------------------------------ uuids


def test_a_uuid_is_hex_and_changes_with_every_input():
    base = ec_uuid("fp", "image", "abc")
    assert is_uuid(base) and "/" not in base and ".." not in base
    assert base == ec_uuid("fp", "image", "abc")  # the same content and settings: the same file
    others = {ec_uuid("fp2", "image", "abc"), ec_uuid("fp", "video", "abc"), ec_uuid("fp", "image", "abd")}
    assert base not in others and len(others) == 3
    assert ec_uuid("fp", "video", "a", "bc") != ec_uuid("fp", "video", "ab", "c")  # parts are separated


@pytest.mark.parametrize("name", ["../etc", "/abs", "ABC", "a" * 63, "g" * 64, ("a" * 64) + "/x"])
def test_a_name_that_is_no_uuid_names_no_file(tmp_path, name):
    assert not is_uuid(name)
    with pytest.raises(ValueError):
        file_path(tmp_path, name)


# ------------------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_file_holds_the_tensor_in_its_dtype_as_vllm_loads_it(tmp_path, dtype):
    uuid = ec_uuid("fp", "image", "x")
    tensor = _tensor(6, dtype=dtype)
    info = write_file(tmp_path, uuid, tensor, {"grid": "[1, 4, 6]"})
    loaded = load_file(str(tmp_path / uuid / FILE_NAME))["ec_cache"]
    assert loaded.dtype == dtype and torch.equal(loaded, tensor)
    assert (info.rows, info.width) == (6, 8)
    assert os.listdir(tmp_path / uuid) == [FILE_NAME]  # no temporary file left
    checked = check_file(tmp_path, uuid, 6, 8)
    assert checked.metadata == {"grid": "[1, 4, 6]"} and checked.size == info.size


def test_rewriting_a_file_replaces_it_and_never_changes_the_old_one_in_place(tmp_path):
    uuid = ec_uuid("fp", "image", "x")
    write_file(tmp_path, uuid, _tensor(4), {})
    path = tmp_path / uuid / FILE_NAME
    with open(path, "rb") as held:  # a reader with the old file open (vLLM memory-maps it)
        before = path.stat().st_ino
        write_file(tmp_path, uuid, _tensor(4) + 1, {})
        assert path.stat().st_ino != before  # a new inode renamed over it
        old = held.read()
    assert old != path.read_bytes()


def test_the_header_check_refuses_wrong_shapes_and_broken_files(tmp_path):
    uuid = ec_uuid("fp", "image", "x")
    with pytest.raises(EcFileMissing, match="is gone"):
        check_file(tmp_path, uuid)
    write_file(tmp_path, uuid, _tensor(4), {})
    with pytest.raises(EcFileMissing, match=r"holds \(4, 8\), not the \(5, 8\)"):
        check_file(tmp_path, uuid, 5, 8)
    with pytest.raises(EcFileMissing, match=r"not the \(4, 16\)"):
        check_file(tmp_path, uuid, 4, 16)
    path = tmp_path / uuid / FILE_NAME
    data = path.read_bytes()
    path.write_bytes(data[:-2])  # truncated: the data ends before the header says
    with pytest.raises(EcFileMissing, match="not one whole"):
        check_file(tmp_path, uuid, 4, 8)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(EcFileMissing, match="not a safetensors file"):
        check_file(tmp_path, uuid)


def test_a_write_that_fails_is_a_storage_error_and_leaves_nothing(tmp_path):
    (tmp_path / "ro").mkdir()
    uuid = ec_uuid("fp", "image", "x")
    (tmp_path / "ro" / uuid).write_text("a file where the directory goes")
    with pytest.raises(EcStorageError) as caught:
        write_file(tmp_path / "ro", uuid, _tensor(4), {})
    assert caught.value.status == 500 and caught.value.code == "ec_storage_error"
    assert EcStorageFull.status == 507 and EcStorageFull.code == "ec_storage_full"


# ------------------------------------------------------------------------------------------------ store


def _put(store: EcStore, name: str, rows: int = 4) -> str:
    uuid = ec_uuid("fp", "image", name)
    store.pin(uuid)
    store.put(uuid, _tensor(rows), {"grid": "[1, 4, 4]"})
    store.unpin([uuid])
    return uuid


def test_a_file_is_reused_while_it_is_there(tmp_path):
    store, metrics = _store(tmp_path)
    uuid = _put(store, "a")
    assert store.lookup(uuid) is not None
    store.unpin([uuid])
    assert metrics.value("vitserve_ec_reuses_total") == 1
    assert metrics.value("vitserve_ec_writes_total") == 1
    (tmp_path / uuid / FILE_NAME).unlink()  # removed behind vitserve's back: a miss, not a reuse
    assert store.lookup(uuid) is None
    assert metrics.value("vitserve_ec_evictions_total", reason="vanished") == 1


def test_unused_files_go_after_the_ttl_but_a_pinned_one_stays(tmp_path):
    clock = Clock()
    store, metrics = _store(tmp_path, clock, ttl_s=60.0)
    a, b = _put(store, "a"), _put(store, "b")
    assert store.lookup(b) is not None  # b is in flight
    clock.now += 61
    store.maintain()
    assert store.uuids() == [b] and not (tmp_path / a).exists()
    assert metrics.value("vitserve_ec_evictions_total", reason="ttl") == 1
    store.unpin([b])  # its TTL runs from now
    clock.now += 30
    store.maintain()
    assert store.uuids() == [b]
    clock.now += 31
    store.maintain()
    assert store.uuids() == [] and metrics.value("vitserve_ec_files") == 0


def test_the_byte_bound_evicts_the_least_recently_used_unpinned_files(tmp_path):
    store, metrics = _store(tmp_path)
    one = _put(store, "probe")
    size = store.bytes
    store.max_bytes = 3 * size
    names = [one] + [_put(store, n) for n in "abc"]  # four files of one size: the oldest goes
    assert store.uuids() == names[1:]
    assert store.lookup(names[1]) is not None  # now the most recently used, and pinned
    _put(store, "d")
    assert names[1] in store.uuids() and names[2] not in store.uuids()
    assert store.bytes <= store.max_bytes
    assert metrics.value("vitserve_ec_bytes") == store.bytes
    assert metrics.value("vitserve_ec_evictions_total", reason="bytes") == 2


def test_the_sweep_removes_empty_directories_but_not_files_or_pinned_ones(tmp_path):
    store, metrics = _store(tmp_path)
    kept = _put(store, "kept")
    (tmp_path / ("e" * 64)).mkdir()  # what vLLM's lookup of a raw image leaves
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("not empty: not vitserve's to remove")
    pending = ec_uuid("fp", "image", "pending")
    store.pin(pending)
    (tmp_path / pending).mkdir()  # about to be written
    store.maintain()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept, "other", pending])
    assert metrics.value("vitserve_ec_swept_dirs_total") == 1


def test_start_up_takes_over_an_earlier_runs_files_and_removes_broken_ones(tmp_path):
    clock = Clock()
    first, _ = _store(tmp_path, clock)
    good = _put(first, "good")
    broken = _put(first, "broken")
    path = tmp_path / broken / FILE_NAME
    path.write_bytes(path.read_bytes()[:-4])
    (tmp_path / good / ".vitserve-tmp123").write_bytes(b"half")  # a write cut short
    foreign = ec_uuid("fp", "image", "foreign")
    write_file(tmp_path, foreign, _tensor(4), {})  # another producer's (no vitserve metadata): left alone
    second, metrics = _store(tmp_path, clock)
    assert second.uuids() == [good]
    assert metrics.value("vitserve_ec_files") == 1
    assert not path.exists() and os.listdir(tmp_path / good) == [FILE_NAME]
    assert (tmp_path / foreign / FILE_NAME).exists()
    assert second.lookup(good) is not None


def test_check_names_a_vanished_file(tmp_path):
    store, _ = _store(tmp_path)
    uuid = _put(store, "a")
    store.check([(uuid, 4, 8)])
    (tmp_path / uuid / FILE_NAME).unlink()
    with pytest.raises(EcFileMissing, match="is gone"):
        store.check([(uuid, 4, 8)])
    assert store.uuids() == []
