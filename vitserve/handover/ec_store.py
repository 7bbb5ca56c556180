"""The encoder-cache directory's lifetime (--llm_transport ec_storage, docs/vllm.md): which files vitserve
holds there, and when each goes.

- A file lives while any request that names it is in flight (`pin` ... `unpin`, counted: one image twice in
  a request is two pins); nothing pinned is ever removed.
- Unpinned, it goes once unused for --ec_ttl_s, or, least recently used first, while the files hold more
  than --ec_storage_gb. Removal is an unlink (vLLM may have it memory-mapped: the mapping stays valid).
- vLLM's connector makes a directory for every item it looks up, raw images included: empty directories
  that hold no file of vitserve's are removed (`maintain`, at most every `sweep_every_s`, on the request path;
  an expired file therefore goes at the next request after its time, not on a timer).
- At start-up (`EcStore(...)`), the files an earlier run left that still hold a whole tensor and vitserve's
  metadata are taken over (the same content and settings give the same uuid, so they are reused); broken
  ones and temporary files are removed (another producer's files are left alone); then the bounds apply.

Thread-safe: files are written on the preprocessing pool while the event loop looks entries up.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from vitserve.handover.ec_files import (
    FILE_NAME,
    TEMP_PREFIX,
    EcFileMissing,
    FileInfo,
    check_file,
    file_path,
    is_uuid,
    write_file,
)
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
        clock: Callable[[], float] = time.monotonic,
        sweep_every_s: float = 5.0,
    ):
        self.root = Path(root)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.clock = clock
        self.sweep_every_s = sweep_every_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        self._bytes = 0
        self._last_sweep = clock()
        self.root.mkdir(parents=True, exist_ok=True)  # preflight made it; it may have gone since
        self._adopt()

    # ------------------------------------------------------------------------------------------ use

    def lookup(self, uuid: str) -> Entry | None:
        """The entry, pinned, when its file is still there (a reuse); else None and nothing pinned."""
        with self._lock:
            entry = self._entries.get(uuid)
            if entry is None:
                return None
            if not file_path(self.root, uuid).is_file():  # removed behind vitserve's back
                self._drop(uuid, "vanished")
                return None
            entry.last_used = self.clock()
            self._entries.move_to_end(uuid)
            self._pins[uuid] += 1
        self.metrics.ec_reuses_total.inc()
        return entry

    def pin(self, uuid: str) -> None:
        """Before a file is written: neither eviction nor the sweep touches it (or its directory)."""
        with self._lock:
            self._pins[uuid] += 1

    def unpin(self, uuids: Iterable[str]) -> None:
        with self._lock:
            for uuid in uuids:
                self._pins[uuid] -= 1
                if self._pins[uuid] <= 0:
                    del self._pins[uuid]
                entry = self._entries.get(uuid)
                if entry is not None:
                    entry.last_used = self.clock()  # its TTL runs from the end of its last request
            self._evict()

    def put(self, uuid: str, tensor: torch.Tensor, metadata: dict[str, str]) -> Entry:
        """Write the file (the caller pinned `uuid`) and hold it; EcStorageError when it cannot be written."""
        info = write_file(self.root, uuid, tensor, {"producer": PRODUCER, **metadata})
        with self._lock:
            old = self._entries.pop(uuid, None)
            self._bytes -= old.info.size if old is not None else 0
            entry = self._entries[uuid] = Entry(uuid, info, self.clock())
            self._bytes += info.size
            self.metrics.ec_writes_total.inc()
            self._evict()
        return entry

    def check(self, expected: Iterable[tuple[str, int, int]]) -> None:
        """Every (uuid, rows, width) a request is about to name is there, whole, with that shape, by its
        header; EcFileMissing otherwise (nothing may go upstream then)."""
        for uuid, rows, width in expected:
            try:
                check_file(self.root, uuid, rows, width)
            except EcFileMissing:
                with self._lock:
                    if uuid in self._entries:
                        self._drop(uuid, "vanished")
                raise

    def maintain(self) -> None:
        """TTL, the byte bound and the sweep of empty directories; at most every sweep_every_s."""
        now = self.clock()
        with self._lock:
            if now - self._last_sweep < self.sweep_every_s:
                return
            self._last_sweep = now
            self._evict()
            keep = set(self._entries) | set(self._pins)
        self._sweep(keep)

    @property
    def bytes(self) -> int:
        return self._bytes

    def uuids(self) -> list[str]:
        """The files held, least recently used first."""
        with self._lock:
            return list(self._entries)

    # ------------------------------------------------------------------------------------------ inside

    def _evict(self) -> None:
        """(Lock held.) Unpinned files past the TTL, then least recently used ones over the byte bound."""
        now = self.clock()
        for uuid, entry in list(self._entries.items()):
            if uuid in self._pins:
                continue
            if now - entry.last_used > self.ttl_s:
                self._drop(uuid, "ttl")
            elif self._bytes > self.max_bytes:
                self._drop(uuid, "bytes")
        self._gauges()

    def _drop(self, uuid: str, reason: str) -> None:
        """(Lock held.) Forget the entry and unlink its file; its directory goes if nothing else is in it."""
        entry = self._entries.pop(uuid)
        self._bytes -= entry.info.size
        path = file_path(self.root, uuid)
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        self.metrics.ec_evictions_total.labels(reason=reason).inc()
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.ec_files.set(len(self._entries))
        self.metrics.ec_bytes.set(self._bytes)

    def _sweep(self, keep: set[str]) -> None:
        """Remove the empty directories vLLM's lookups left (rmdir fails on one that is not empty)."""
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for child in it:
                if child.name not in keep and child.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(child.path)
                        self.metrics.ec_swept_dirs_total.inc()

    def _adopt(self) -> None:
        """Take over an earlier run's files (oldest first, by mtime), remove broken ones and temporary files,
        sweep empty directories, then apply the bounds."""
        found: list[tuple[float, str, FileInfo]] = []
        with os.scandir(self.root) as it:
            children = [c for c in it if c.is_dir(follow_symlinks=False)]
        for child in children:
            for leftover in Path(child.path).glob(TEMP_PREFIX + "*"):
                with contextlib.suppress(OSError):
                    leftover.unlink()
            path = Path(child.path) / FILE_NAME
            if not is_uuid(child.name) or not path.is_file():
                continue
            try:
                info = check_file(self.root, child.name)
                age = time.time() - path.stat().st_mtime
            except (EcFileMissing, OSError):
                info = None
            if info is None:  # a broken file would kill vLLM's engine if a uuid named it
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if info.metadata.get("producer") != PRODUCER:
                continue  # another producer's: not vitserve's to remove
            found.append((self.clock() - max(age, 0.0), child.name, info))
        with self._lock:
            for last_used, uuid, info in sorted(found):
                self._entries[uuid] = Entry(uuid, info, last_used)
                self._bytes += info.size
            self._evict()
            keep = set(self._entries)
        self._sweep(keep)
