"""What every process sharing one --ec_storage_path sees of the others (handover/ec_store.py,
docs/vllm.md): pins, and the files as they are on disk.

A pin is a shared `flock` on `DIR/.vitserve-pins/<uuid>`, held by the process that pins the uuid for as long
as any request of its names it. A removal (eviction, the clean-up of an earlier run's leftovers) takes an
exclusive lock on the same file without waiting: it fails while any process holds a pin, and it holds off
new pins while the file goes. The lock file goes too, under that lock, so a pinner checks after locking that
the name still leads to the file it locked, and locks afresh if not.

The kernel drops a process's locks when it exits or is killed, so a crashed replica's pins do not outlive it
(on NFS, Linux emulates `flock` with byte-range locks, which the server's lock lease frees when a client is
gone). vLLM's view is untouched: it only opens `DIR/<uuid>/encoder_cache.safetensors`, and nothing is added
inside a uuid's directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vitserve.handover.ec_files import FILE_NAME, EcStorageError, is_uuid

PINS_DIR = ".vitserve-pins"  # in DIR, beside the uuids' directories (no uuid: 64 hex digits)


class DirPins:
    def __init__(self, root: Path):
        self.dir = Path(root) / PINS_DIR

    def hold(self, uuid: str) -> int:
        """Pin `uuid` for every process: the descriptor that holds the shared lock (`os.close` lets go).
        Waits only while a removal of that uuid is under way (an unlink or two)."""
        path = self._path(uuid)
        while True:
            fd = self._open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if _still_named(fd, path):
                    return fd
            except OSError as exc:
                os.close(fd)
                raise EcStorageError(f"pinning {path}: {exc.strerror or exc} (--ec_storage_path)") from None
            os.close(fd)  # it was removed (and the uuid's file with it) while we waited: lock a new one

    def remove_if_free(self, uuid: str, remove: Callable[[], None]) -> bool:
        """Run `remove` and forget the lock file if no process pins `uuid` (False, nothing done, otherwise);
        no process can pin it meanwhile."""
        path = self._path(uuid)
        try:
            fd = self._open(path)
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # pinned (BlockingIOError), or the lock cannot be had: leave it
            if not _still_named(fd, path):
                return False  # another removal got there first
            remove()
            with contextlib.suppress(OSError):
                os.unlink(path)
            return True
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        """The uuids that have a lock file (pinned now, or left by a request that never wrote its file)."""
        try:
            return [name for name in os.listdir(self.dir) if is_uuid(name)]
        except OSError:
            return []

    def _path(self, uuid: str) -> str:
        if not is_uuid(uuid):  # never a path of the caller's making
            raise ValueError(f"not an encoder-cache uuid: {uuid!r:.80}")
        return os.path.join(self.dir, uuid)

    def _open(self, path: str) -> int:
        # read-write: NFS's emulation of flock takes an exclusive lock only on a file open for writing
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # the pins' directory is new, or someone removed it
            self.dir.mkdir(parents=True, exist_ok=True)
            return os.open(path, flags, 0o644)


def _still_named(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class OnDisk:
    """One uuid's file as the directory says it is."""

    uuid: str
    size: int
    used: float  # its mtime: the store's clock at its last write or use, in any process
    changed: int  # its ctime in ns: breaks ties between equal `used`

    @property
    def age_key(self) -> tuple[float, int]:
        return self.used, self.changed


def scan(root: Path) -> list[OnDisk]:
    """Every uuid's file in the directory, least recently used first (one stat each, no file opened)."""
    found = []
    with contextlib.suppress(OSError), os.scandir(root) as it:
        for child in it:
            if not is_uuid(child.name):
                continue  # the pins' directory, another tool's
            try:
                st = os.stat(os.path.join(child.path, FILE_NAME))
            except OSError:  # an empty directory vLLM's lookup left, or removed since the listing
                continue
            found.append(OnDisk(child.name, st.st_size, st.st_mtime, st.st_ctime_ns))
    found.sort(key=lambda f: f.age_key)
    return found
