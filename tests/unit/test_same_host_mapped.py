"""The kept mappings of pool files (vitserve/handover/mapped.py): a second write over the same pool file goes
through the mapping kept from the first, with the bytes write(2) would have written; never into a hole (SIGBUS on
a full device), never keeping a flock, never pinning a deleted file's pages past the next write. Real files and
flocks, a real 1 MiB tmpfs where this machine lets a test mount one."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_connector_handoff import message
from tests.unit.test_connector_hostile import tmpfs  # noqa: F401  # the 1 MiB tmpfs fixture
from vitserve.connector.pool import POOL
from vitserve.handover.mapped import MAPPINGS, MAX_MAPPED, PRUNE_EVERY_S
from vitserve.handover.same_host import write_file
from vitserve.rpc.handoff import sampled_crc, write_rows


@pytest.fixture(autouse=True)
def fresh_mappings():
    MAPPINGS.clear()
    MAPPINGS.mapped = 0
    yield
    MAPPINGS.clear()


def area(root: Path) -> Path:
    """A connector's incoming area and its pool beside it (connector/handoff.py, connector/pool.py)."""
    (root / ".incoming").mkdir(mode=0o700, parents=True)
    (root / POOL).mkdir(mode=0o700)
    return root / ".incoming"


def write(incoming: Path, uuid: str, rows: int = 12):
    return write_file(incoming, message(uuid, rows), torch.bfloat16, time.time() + 60)


def give_back(incoming: Path, name: str, k: int) -> Path:
    """The connector lets the entry go: its file goes to the pool (a rename: the same inode)."""
    to = incoming.parent / POOL / f"p-{k:032x}"
    os.rename(incoming / name, to)
    return to


def reference(tmp_path: Path, uuid: str, rows: int = 12) -> bytes:
    """What write(2) writes for the same message (rpc/handoff.write_rows), into a file of its own."""
    m = message(uuid, rows)
    path = tmp_path / f"ref-{uuid[:4]}-{rows}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        write_rows(fd, [m.embedding, *m.deepstack], torch.bfloat16)
    finally:
        os.close(fd)
    return path.read_bytes()


def fill(path: Path) -> None:
    """Write zeros into `path` until the device is full."""
    with open(path, "wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):  # noqa: PT012
        while True:  # the loop is what raises
            f.write(b"\0" * 4096)


def test_the_second_write_over_a_pool_file_goes_through_the_kept_mapping_with_write2s_bytes(tmp_path):
    incoming = area(tmp_path / "c")
    first = write(incoming, "a" * 64)  # a fresh file: write(2)
    assert not first.recycled
    assert len(MAPPINGS) == 0
    inode = os.stat(incoming / first.name).st_ino
    give_back(incoming, first.name, 1)
    second = write(incoming, "b" * 64)  # the pool file, mapped now (building its page table)
    assert second.recycled
    assert (len(MAPPINGS), MAPPINGS.mapped) == (1, 0)
    give_back(incoming, second.name, 2)
    third = write(incoming, "c" * 64)  # the same file again: through the kept mapping
    assert third.recycled
    assert (len(MAPPINGS), MAPPINGS.mapped) == (1, 1)
    path = incoming / third.name
    assert os.stat(path).st_ino == inode
    # the cast is the same rounding either way (float32 to bfloat16, to nearest even): equal bytes by construction
    assert path.read_bytes() == reference(tmp_path, "c" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert sampled_crc(fd, third.nbytes, third.sample) == third.crc
    finally:
        os.close(fd)


def test_no_lock_outlives_the_write(tmp_path):
    """The mapping holds its file open: on the claim's description, its exclusive flock would stay, and vLLM's
    worker (a shared flock, files.read_entry) could never read the file."""
    incoming = area(tmp_path / "c")
    for k, uuid in enumerate(("a" * 64, "b" * 64, "c" * 64)):
        f = write(incoming, uuid)
        fd = os.open(incoming / f.name, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if any lock is held
        finally:
            os.close(fd)
        give_back(incoming, f.name, k)
    assert MAPPINGS.mapped == 1


@pytest.mark.parametrize("how", ["shorter", "sparse"])
def test_a_pool_file_with_a_hole_is_written_with_write2(tmp_path, how):
    """A claim that lengthens a file leaves a hole at its end; a sparse file has holes throughout. A store into
    a hole through a mapping would allocate, and raise SIGBUS on a full device: write(2) it is."""
    incoming = area(tmp_path / "c")
    rows = 200
    nbytes = rows * 24 * 2  # message(uuid, 200) in bfloat16: 9,600 bytes, three pages
    pooled = incoming.parent / POOL / f"p-{1:032x}"
    with open(pooled, "wb") as f:
        if how == "shorter":
            f.write(b"\1" * 64)
        else:
            f.truncate(nbytes)
    f = write(incoming, "a" * 64, rows)
    assert f.recycled
    assert len(MAPPINGS) == 0
    assert (incoming / f.name).read_bytes() == reference(tmp_path, "a" * 64, rows)


def test_a_deleted_file_loses_its_mapping_at_the_next_write_and_at_most_max_mapped_are_kept(tmp_path):
    incoming = area(tmp_path / "c")
    files = [write(incoming, f"{k:064x}") for k in range(MAX_MAPPED + 2)]  # fresh files
    for k, f in enumerate(files):
        give_back(incoming, f.name, k)
    claimed = [write(incoming, f"{k + 100:064x}") for k in range(MAX_MAPPED + 2)]  # each claims one: mapped
    assert all(f.recycled for f in claimed)
    assert len(MAPPINGS) == MAX_MAPPED  # the oldest dropped
    os.unlink(incoming / claimed[-1].name)  # the connector deleted it (its pool full, say)
    give_back(incoming, claimed[-2].name, 50)
    write(incoming, "f" * 64)  # claims claimed[-2]'s file: through its kept mapping
    assert MAPPINGS.mapped == 1
    assert len(MAPPINGS) == MAX_MAPPED - 1  # the deleted file's mapping went: its pages with it


def test_on_a_full_device_a_mapped_write_needs_no_page_and_a_longer_one_is_enospc(tmpfs):  # noqa: F811
    """On a 1 MiB tmpfs: over a file whose pages exist, the mapping writes with the device full; a claim that
    lengthens a file writes with write(2), which answers ENOSPC (the file removed), never SIGBUS."""
    incoming = area(tmpfs)
    rows = 4096  # 4096 x 24 bfloat16: 192 KiB
    first = write(incoming, "a" * 64, rows)
    give_back(incoming, first.name, 1)
    second = write(incoming, "b" * 64, rows)  # mapped
    give_back(incoming, second.name, 2)
    fill(tmpfs / "another-users-file")  # the device fills up
    third = write(incoming, "c" * 64, rows)  # the kept mapping: no new page
    assert MAPPINGS.mapped == 1
    m = message("c" * 64, rows)
    rows_bf16 = torch.cat([m.embedding, *m.deepstack], dim=1).to(torch.bfloat16)  # the layout, row by row
    assert (incoming / third.name).read_bytes() == rows_bf16.view(torch.uint8).numpy().tobytes()
    give_back(incoming, third.name, 3)
    with pytest.raises(OSError, match="No space left"):  # longer than the pool file: its new pages do not fit
        write(incoming, "d" * 64, rows * 2)
    assert list(incoming.iterdir()) == []


def test_a_file_the_connector_deletes_loses_its_mapping_within_a_few_prune_periods(tmp_path):
    """No write comes after (an idle vitserve): the pruning thread lets go of the deleted file's mapping."""
    incoming = area(tmp_path / "c")
    first = write(incoming, "a" * 64)
    give_back(incoming, first.name, 1)
    second = write(incoming, "b" * 64)  # mapped
    assert len(MAPPINGS) == 1
    os.unlink(incoming / second.name)  # the connector deleted it
    deadline = time.monotonic() + 30 * PRUNE_EVERY_S  # a deadline for liveness, not a timing claim
    while len(MAPPINGS) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(MAPPINGS) == 0
