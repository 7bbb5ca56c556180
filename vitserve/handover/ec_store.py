"""The encoder-cache directory's lifetime (--llm_transport ec_storage, docs/vllm.md): which files vitserve
holds there, and when each goes. Several vitserve replicas may share the directory: what decides is the
directory itself (handover/ec_pins.py), never one process's memory.

- A file lives while any request that names it is in flight, in any process (`pin` ... `unpin`, counted here:
  one image twice in a request is two pins; the first pin takes a lock every process sees, the last lets it
  go); nothing pinned is ever removed. A replica that dies lets its pins go with it.
- A file's mtime is the store's clock at its last write or use (`unpin` sets it), so every process reads the
  same last use. Unpinned, it goes once unused for --ec_ttl_s, or, least recently used first, while the
  directory's files (those of every replica) hold more than --ec_storage_gb. The bound is applied after each
  write, after an unpin while it was exceeded, and at each upkeep; it can only be exceeded while pinned files
  alone exceed it, or for a write another replica has not yet evicted for. Removal is an unlink (vLLM may
  have it memory-mapped: the mapping stays valid).
- A lookup finds a file any replica wrote (a reuse); its header (grid, producer) is read once per process.
- vLLM's connector makes a directory for every item it looks up, raw images included: empty directories
  are removed (`maintain`, at most every `sweep_every_s`, on the request path; an expired file therefore goes
  at the next request after its time, not on a timer), and so are lock files left with no file.
- At start-up (`EcStore(...)`), broken files and temporary files no process is writing are removed (another
  producer's files are left alone); then the bounds apply. The same content and settings give the same uuid,
  so an earlier run's files are reused.

Thread-safe: files are written on the preprocessing pool while the event loop looks entries up.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from vitserve.handover.ec_files import (
    TEMP_PREFIX,
    EcFileMissing,
    FileInfo,
    check_file,
    file_path,
    is_uuid,
    write_file,
)
from vitserve.handover.ec_pins import PINS_DIR, DirPins, OnDisk, scan
from vitserve.metrics import Metrics

PRODUCER = "vitserve"  # the `producer` metadata of every file vitserve writes


@dataclass
class Entry:
    """One file vitserve holds."""

    uuid: str
    info: FileInfo
    last_used: float  # the clock's time


class EcStore:
    def __init__(
        self,
        root: Path,
        *,
        ttl_s: float,
        max_bytes: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,  # wall time: it is written into mtimes every process reads
        sweep_every_s: float = 5.0,
        rescan_s: float = 1.0,
    ):
        self.root = Path(root)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.clock = clock
        self.sweep_every_s = sweep_every_s
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._shared = DirPins(self.root)
        self._pins: Counter[str] = Counter()  # this process's requests in flight, per uuid
        self._held: dict[str, int] = {}  # uuid -> the descriptor of this process's shared lock
        self._known: dict[str, FileInfo] = {}  # vitserve's files' headers (a uuid fixes its content)
        self._foreign: set[str] = set()  # files that are not vitserve's
        # vitserve's files in the directory: scanned at most every rescan_s (a scan stats every file: ~5 us
        # each, more under load), with this process's writes, uses and removals since
        self._view: dict[str, OnDisk] = {}
        self._scanned = float("-inf")  # time.monotonic() of the last scan
        self._bytes = 0  # the view's
        self._over = False  # the view held more than max_bytes after the last eviction
        self._last_sweep = clock()
        self.root.mkdir(parents=True, exist_ok=True)  # preflight made it; it may have gone since
        self._adopt()

    # ------------------------------------------------------------------------------------------ use

    def lookup(self, uuid: str) -> Entry | None:
        """The entry, pinned, when its file (any replica's) is there (a reuse); else None, nothing pinned."""
        with self._lock:
            self._pin(uuid)
            info = self._info(uuid)
            if info is None:
                self._unpin(uuid)
                return None
            now = self._touch(uuid)
        self.metrics.ec_reuses_total.inc()
        return Entry(uuid, info, now)

    def pin(self, uuid: str) -> None:
        """Before a file is written: no process's eviction or sweep touches it (or its directory)."""
        with self._lock:
            self._pin(uuid)

    def unpin(self, uuids: Iterable[str]) -> None:
        with self._lock:
            for uuid in uuids:
                self._touch(uuid)  # its TTL runs from the end of its last request
                self._unpin(uuid)
            if self._over:
                self._evict()

    def put(self, uuid: str, tensor: torch.Tensor, metadata: dict[str, str]) -> Entry:
        """Write the file (the caller pinned `uuid`) and hold it; EcStorageError when it cannot be written."""
        info = write_file(self.root, uuid, tensor, {"producer": PRODUCER, **metadata})
        with self._lock:
            now = self._touch(uuid, info.size)
            self._known[uuid] = info
            self._foreign.discard(uuid)
            self.metrics.ec_writes_total.inc()
            self._evict()
        return Entry(uuid, info, now)

    def check(self, expected: Iterable[tuple[str, int, int]]) -> None:
        """Every (uuid, rows, width) a request is about to name is there, whole, with that shape, by its
        header; EcFileMissing otherwise (nothing may go upstream then)."""
        for uuid, rows, width in expected:
            try:
                check_file(self.root, uuid, rows, width)
            except EcFileMissing:
                with self._lock:
                    if self._known.pop(uuid, None) is not None:
                        self.metrics.ec_evictions_total.labels(reason="vanished").inc()
                raise

    def maintain(self) -> None:
        """TTL, the byte bound, the sweep of empty directories and stale lock files; at most every
        sweep_every_s."""
        now = self.clock()
        with self._lock:
            if now - self._last_sweep < self.sweep_every_s:
                return
            self._last_sweep = now
            self._evict(rescan=True)
            keep = set(self._pins)
        self._sweep(keep)

    @property
    def bytes(self) -> int:
        """The bytes of vitserve's files in the directory (every replica's), at the last upkeep."""
        return self._bytes

    def uuids(self) -> list[str]:
        """vitserve's files in the directory now, least recently used first."""
        with self._lock:
            return [f.uuid for f in self._ours(scan(self.root))]

    # ------------------------------------------------------------------------------------------ inside

    def _pin(self, uuid: str) -> None:
        """(Lock held.) The first pin of this process takes the shared lock."""
        if self._pins[uuid] == 0:
            self._held[uuid] = self._shared.hold(uuid)
        self._pins[uuid] += 1

    def _unpin(self, uuid: str) -> None:
        """(Lock held.) The last pin of this process lets the shared lock go."""
        self._pins[uuid] -= 1
        if self._pins[uuid] <= 0:
            del self._pins[uuid]
            fd = self._held.pop(uuid, None)
            if fd is not None:
                os.close(fd)

    def _touch(self, uuid: str, size: int | None = None) -> float:
        """(Lock held.) Record a use (or a write of `size` bytes) in the file's mtime, where every replica
        reads it, and in the view."""
        now = self.clock()
        with contextlib.suppress(OSError):
            os.utime(file_path(self.root, uuid), (now, now))
        seen = self._view.get(uuid)
        if size is not None or seen is not None:
            size = seen.size if size is None and seen is not None else size or 0
            self._view[uuid] = OnDisk(uuid, size, now, time.time_ns())
        return now

    def _info(self, uuid: str) -> FileInfo | None:
        """(Lock held.) The header of vitserve's file for `uuid` when it is there (read once per process)."""
        known = self._known.get(uuid)
        if known is not None:
            if file_path(self.root, uuid).is_file():
                return known
            del self._known[uuid]  # removed behind this process's back
            self.metrics.ec_evictions_total.labels(reason="vanished").inc()
            return None
        return self._known.get(uuid) if self._is_ours(uuid) else None

    def _is_ours(self, uuid: str) -> bool:
        """(Lock held.) Whether the uuid's file is there, whole and vitserve's (its header read once)."""
        if uuid in self._known:
            return True
        if uuid in self._foreign:
            return False
        try:
            info = check_file(self.root, uuid)
        except EcFileMissing:
            return False  # gone, or broken: a lookup writes it again
        if info.metadata.get("producer") != PRODUCER:
            self._foreign.add(uuid)  # another producer's: not vitserve's to count or remove
            return False
        self._known[uuid] = info
        return True

    def _ours(self, found: list[OnDisk]) -> list[OnDisk]:
        """(Lock held.) vitserve's files among those found; what this process remembers of the others goes."""
        present = {f.uuid for f in found}
        self._known = {u: i for u, i in self._known.items() if u in present}
        self._foreign &= present
        return [f for f in found if self._is_ours(f.uuid)]

    def _evict(self, rescan: bool = False) -> None:
        """(Lock held.) Unpinned files past the TTL (checked at each upkeep), then least recently used ones
        over the byte bound, of the directory as every replica left it (scanned again if asked, or when the
        last scan is rescan_s old: the bound may be passed by what other replicas wrote since)."""
        if rescan or time.monotonic() - self._scanned >= self.rescan_s:
            self._view = {f.uuid: f for f in self._ours(scan(self.root))}
            self._scanned = time.monotonic()
        total = sum(f.size for f in self._view.values())
        now = self.clock()
        if rescan or total > self.max_bytes:
            for f in sorted(self._view.values(), key=lambda f: f.age_key):  # least recently used first
                expired = now - f.used > self.ttl_s
                if not expired and total <= self.max_bytes:
                    break  # the rest are newer
                if f.uuid not in self._pins and self._remove(f.uuid, "ttl" if expired else "bytes"):
                    total -= f.size
        self._bytes, self._over = total, total > self.max_bytes
        self.metrics.ec_files.set(len(self._view))
        self.metrics.ec_bytes.set(total)

    def _remove(self, uuid: str, reason: str) -> bool:
        """(Lock held.) Unlink the file and its directory unless some process pins it."""
        path = file_path(self.root, uuid)
        if not path.exists():  # another replica removed it since the scan
            self._view.pop(uuid, None)
            return True

        def remove() -> None:
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()

        if not self._shared.remove_if_free(uuid, remove):
            return False
        self._known.pop(uuid, None)
        self._view.pop(uuid, None)
        self.metrics.ec_evictions_total.labels(reason=reason).inc()
        return True

    def _sweep(self, keep: set[str]) -> None:
        """Remove the empty directories vLLM's lookups left (rmdir fails on one that is not empty; a writer
        whose directory goes before its file is in it makes it again), and lock files with no file."""
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for child in it:
                if child.name not in keep and child.name != PINS_DIR and child.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(child.path)
                        self.metrics.ec_swept_dirs_total.inc()
        for uuid in self._shared.names():
            if uuid not in keep and not file_path(self.root, uuid).exists():
                self._shared.remove_if_free(uuid, lambda: None)

    def _adopt(self) -> None:
        """Remove broken files and temporary files no process is writing, then apply the bounds and sweep."""
        with os.scandir(self.root) as it:
            children = [c.name for c in it if is_uuid(c.name) and c.is_dir(follow_symlinks=False)]
        for uuid in children:
            leftovers = list((self.root / uuid).glob(TEMP_PREFIX + "*"))
            path = file_path(self.root, uuid)
            broken = path.is_file() and not self._whole(uuid)
            if leftovers or broken:  # a writer pins its uuid: these are a dead writer's
                self._shared.remove_if_free(uuid, functools.partial(_unlink, leftovers, path, broken))
        with self._lock:
            self._evict(rescan=True)
        self._sweep(set())

    def _whole(self, uuid: str) -> bool:
        try:
            check_file(self.root, uuid)
        except EcFileMissing:
            return False  # a broken file would kill vLLM's engine if a uuid named it
        return True


def _unlink(leftovers: list[Path], path: Path, broken: bool) -> None:
    for leftover in [*leftovers, path] if broken else leftovers:
        with contextlib.suppress(OSError):
            leftover.unlink()
