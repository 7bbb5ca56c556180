"""Recycled pages for the same-host hand-over (handoff.py; docs/vllm.md, "One host: one write"). A fresh 88.5 MB
file on /dev/shm costs ~40 ms to write, the kernel allocating its pages 4 KiB at a time; overwriting the pages of
an existing file costs ~14 ms (bench/RESULTS.md, issue 51). So the files of entries the ledger lets go are not
deleted but kept, a few, in `<store dir>/.pool`, and vitserve's next same-host write claims one and overwrites it.

Who may write a file, and when (the file's owner changes only by a rename, which is atomic):
- held: the connector's (its digest name in the store's directory). vLLM's worker reads it under a shared flock
  (files.read_entry) while a request that named it is pinned;
- the ledger lets it go (spent or expired: no pin, so no request will load it) and the receiver moves it to the
  pool, under the bound below (else it is deleted as before). A pool file is nobody's;
- vitserve claims one by renaming it to a fresh incoming name of its own (`claim`): of two writers only one rename
  succeeds, the other gets ENOENT and tries the next file (or writes a fresh one). It then takes an exclusive
  flock without waiting: a worker still reading the file (a load that raced its release) holds the shared one,
  and vitserve then deletes the file (the worker keeps its pages) and tries the next. vitserve writes, releases the
  lock, and announces the file: from there the connector checks and adopts it as any file vitserve wrote;
- a worker that opened the file before it went to the pool but locks it only later finds that its path no longer
  names it (files.read_entry) and raises FileNotFoundError, as it would have for the deleted file.

The bound: at most POOL_FILES files and POOL_MAX_BYTES bytes, never more than the store's max_bytes. These are on
top of max_gb (the pool holds no embedding); a full device (ENOSPC) empties the pool before anything held is
evicted. Counters: `pooled` (files kept instead of deleted), gauges `pool_files` and `pool_bytes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import threading
import uuid as uuid_mod
from collections.abc import Iterable
from pathlib import Path

POOL = ".pool"  # in the store's directory, beside the incoming area (handoff.INCOMING): one device, renames
POOL_NAME = re.compile(r"p-[0-9a-f]{32}")
POOL_FILES = 4
POOL_MAX_BYTES = 1 << 30


class Pool:
    """The connector's side: `take` the files of entries let go (kept or deleted), `drain`, `counters`."""

    def __init__(self, store_dir: Path, max_bytes: int) -> None:
        self.path = store_dir / POOL
        self.path.mkdir(mode=0o700)
        self.max_files, self.max_bytes = POOL_FILES, min(POOL_MAX_BYTES, max_bytes)
        self.pooled = 0
        self._lock = threading.Lock()  # the receiver thread and a pull's accept may both let entries go

    def take(self, paths: Iterable[Path]) -> None:
        """Keep each file in the pool while it has room, else delete it."""
        with self._lock:
            files, nbytes = self._contents()
            for path in paths:
                with contextlib.suppress(OSError):
                    size = os.stat(path, follow_symlinks=False).st_size
                    if files < self.max_files and nbytes + size <= self.max_bytes:
                        os.rename(path, self.path / f"p-{uuid_mod.uuid4().hex}")
                        files, nbytes, self.pooled = files + 1, nbytes + size, self.pooled + 1
                        continue
                with contextlib.suppress(OSError):
                    path.unlink()

    def drain(self) -> None:
        """Delete every pool file (the device is full: their pages are worth more as room)."""
        with self._lock, contextlib.suppress(OSError), os.scandir(self.path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def counters(self) -> dict[str, int]:
        files, nbytes = self._contents()
        return {"pooled": self.pooled, "pool_files": files, "pool_bytes": nbytes}

    def _contents(self) -> tuple[int, int]:
        """(files, bytes) in the pool now (vitserve may take one meanwhile: an overestimate, never under)."""
        files = nbytes = 0
        # OSError: the directory is gone (the store closed)
        with contextlib.suppress(OSError), os.scandir(self.path) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    nbytes += entry.stat(follow_symlinks=False).st_size
                    files += 1
        return files, nbytes


def claim(incoming: Path, nbytes: int) -> tuple[str, int] | None:
    """vitserve's side: a pool file renamed to a fresh incoming name (handoff.NAME), open for writing, locked
    exclusively and sized to `nbytes`: (name, fd); None when the pool (an older connector has none) has no free
    file. The caller writes from offset 0, and closes the fd (the lock goes with it) before announcing it."""
    sizes = {}
    try:
        with os.scandir(incoming.parent / POOL) as it:
            for e in it:
                with contextlib.suppress(OSError):  # ENOENT: another writer took it since the listing
                    if POOL_NAME.fullmatch(e.name):
                        sizes[e.path] = e.stat(follow_symlinks=False).st_size
    except OSError:
        return None
    # a file at least as large first (shrinking keeps its pages), the closest size first
    for path in sorted(sizes, key=lambda p: (sizes[p] < nbytes, abs(sizes[p] - nbytes))):
        name = f"in-{uuid_mod.uuid4().hex}"  # handoff.NAME
        try:
            os.utime(path)  # new to the incoming area's sweep, which removes files not written for a while
            os.rename(path, incoming / name)
        except OSError:  # ENOENT: another writer took it first
            continue
        fd = _lock(incoming / name, nbytes)
        if fd is not None:
            return name, fd
    return None


def _lock(path: Path, nbytes: int) -> int | None:
    """The claimed file open, locked and sized; None (and the file deleted) when a reader still holds it."""
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OSError(f"{path} is not a regular file with one link")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a worker is reading it
        if st.st_size != nbytes:
            os.ftruncate(fd, nbytes)  # shorter: its tail's pages go; longer: the new ones come as written
    except OSError:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return fd
