"""Writable shared mappings of the connector's pool files that this process wrote (same_host.write_file over
a file of connector/pool.py), kept, so that its next write over the same file is one cast into pages that are
mapped already. write(2) over an existing 88.5 MB file on /dev/shm costs ~14 ms of kernel work per 4 KiB page;
a copy into a mapping whose page table is built costs what memcpy does (bench/RESULTS.md, issue 51). The first
write through a new mapping costs what write(2) does (building the page table), so a file's first hand-over
costs the same either way and every later one is cheaper.

When a file is written through its mapping:
- it is a pool file vitserve claimed (renamed to its own incoming name, locked exclusively: pool.claim), so no
  reader or other writer touches it meanwhile;
- its every page is allocated (st_blocks covers st_size). A store through a mapping into a hole allocates a page,
  and on a full device the kernel answers with SIGBUS where write(2) answers ENOSPC; a file that a claim made
  longer (a hole at its end) is written with write(2), which then allocates its pages;
- the mapping comes from an open file description of its own, without the claim's flock: the mapping keeps
  its file open, and a kept flock would lock vLLM's worker out of the file it must read.

What is kept, and for how long: at most MAX_MAPPED mappings (the pool's POOL_FILES), the least recently written
dropped first. A mapped file keeps its pages while the mapping lives, even once the connector deleted it (its
pool full, a full device's drain, a restart that removed its directory): so the mappings of files that no longer
have a name (st_nlink 0) are dropped (`prune`) before each write (same_host.write_file, before its claim), and,
while anything is mapped, by a daemon thread every PRUNE_EVERY_S, so that an idle vitserve keeps a deleted file's
pages at most that long. `clear` drops them all (the connector changed). A mapping is never unmapped under a
write: dropping one only lets go of this cache's reference, and the tensor a write places through keeps the
mapping alive until that write ends.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vitserve.connector.pool import POOL_FILES
from vitserve.rpc.handoff import place_side_by_side

MAX_MAPPED = POOL_FILES
PRUNE_EVERY_S = 1.0


@dataclass
class _Mapped:
    mm: mmap.mmap
    fd: int  # the mapping's own open file (no flock): fstat says when the file is deleted

    def alive(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def drop(self) -> None:
        os.close(self.fd)  # the mapping itself goes with its last reference (never under a write)


class Mappings:
    """The kept mappings of this process (`MAPPINGS`): `write`, `clear`, and `mapped`, the writes placed through
    a mapping kept from an earlier write."""

    def __init__(self, max_mapped: int = MAX_MAPPED) -> None:
        self.max_mapped = max_mapped
        self.mapped = 0
        self._maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()  # (st_dev, st_ino), oldest first
        self._lock = threading.Lock()
        self._pruner: threading.Thread | None = None

    def write(
        self, path: Path, fd: int, parts: Sequence[torch.Tensor], dtype: torch.dtype, nbytes: int
    ) -> bool:
        """Place (rows, sum of widths) in `dtype` into the claimed pool file `path` (open as `fd`, sized to
        `nbytes` by the claim) through its mapping: True; False, having written nothing, when its pages are not
        all allocated (the caller writes with write(2))."""
        st = os.fstat(fd)
        if nbytes == 0 or st.st_size != nbytes or st.st_blocks * 512 < nbytes:
            return False
        key = (st.st_dev, st.st_ino)  # unique while kept: the mapping's open file keeps the inode in use
        with self._lock:
            entry = self._maps.pop(key, None)
            if entry is not None and len(entry.mm) != nbytes:
                entry.drop()
                entry = None
            kept = entry is not None
            if entry is None:
                own = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a description of its own: no flock
                try:
                    entry = _Mapped(mmap.mmap(own, nbytes), own)
                except BaseException:
                    os.close(own)
                    raise
            self._maps[key] = entry
            if self._pruner is None or not self._pruner.is_alive():  # a fork's child has none: started anew
                self._pruner = threading.Thread(
                    target=self._prune_while_mapped, name="vitserve-mappings", daemon=True
                )
                self._pruner.start()
            while len(self._maps) > self.max_mapped:
                self._maps.popitem(last=False)[1].drop()
            self.mapped += kept
            mm = entry.mm  # this write's reference: the mapping outlives a drop meanwhile
        place_rows(mm, parts, dtype)
        return True

    def clear(self) -> None:
        with self._lock:
            while self._maps:
                self._maps.popitem()[1].drop()

    def prune(self) -> None:
        """Drop the mappings of files that no longer have a name: their pages go back to the device."""
        with self._lock:
            self._prune()

    def __len__(self) -> int:
        return len(self._maps)

    def _prune(self) -> None:
        for key in [k for k, e in self._maps.items() if not e.alive()]:
            self._maps.pop(key).drop()

    def _prune_while_mapped(self) -> None:
        while True:
            time.sleep(PRUNE_EVERY_S)
            with self._lock:
                self._prune()
                if not self._maps:
                    self._pruner = None
                    return


def place_rows(buffer: mmap.mmap, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """The rows in `dtype` into `buffer`, in rpc/handoff.write_rows' layout."""
    rows, width = int(parts[0].shape[0]), sum(int(p.shape[1]) for p in parts)
    place_side_by_side(torch.frombuffer(buffer, dtype=dtype, count=rows * width).view(rows, width), parts)


MAPPINGS = Mappings()
