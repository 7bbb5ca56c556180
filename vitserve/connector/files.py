"""The connector's directory of tensors in shared memory: one raw file per uuid, named by the uuid's sha256 (64 hex
characters, whatever the uuid holds: no name a peer sends reaches the file system), written to `<name>.tmp` and
renamed, so a worker never sees a partial file, and the temporary file removed on every failure.

Each live directory is `vitserve-ec-<pid>-<random>` under the root (/dev/shm by default), and its store holds an
exclusive flock on `<dir>/.lock` for its whole life. A directory whose lock can be taken is an orphan (its vLLM was
killed): the next store's start removes it, tensors and temporary files with it. A lock says "alive" across PID
namespaces (two containers sharing /dev/shm with `--ipc=host`), which a pid in the name cannot. A directory gets its
lock before it gets its name (it is made under a `.vitserve-ec-new-` name and renamed), so a starting store is
never taken for an orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vitserve.rpc.fileio import read_into
from vitserve.rpc.tensors import DTYPES, tensor_to_buffer

PREFIX = "vitserve-ec-"
STAGING = f".{PREFIX}new-"  # a directory being made, before it has its lock and its name
STAGING_S = 60.0  # a staging directory without a lock this old was left by a start that died
LOCK_NAME = ".lock"
HUGE_PAGE_MIN_BYTES = 4 << 20  # read_entry maps tensors from this size on (_empty)
HUGE_PAGE_BYTES = 2 << 20
KEPT_BUFFERS = 4  # read_entry's buffers kept for reuse in each worker (_Buffers)
TEMP_SUFFIX = ".tmp"
CHUNK_BYTES = (
    8 << 20
)  # rows of main + DeepStack levels interleaved per write: a bounded copy, not the whole tensor


def file_name(uuid: str) -> str:
    """The file of a uuid: fixed length, hex only, for any string."""
    return hashlib.sha256(uuid.encode("utf-8", "surrogatepass")).hexdigest()


class TensorDir:
    """A fresh locked directory under `root` (orphans removed first); `close()` deletes it and drops the lock."""

    def __init__(self, root: Path, log: logging.Logger) -> None:
        self.log = log
        remove_orphans(root, log)
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=root))
        self._lock_fd = os.open(staging / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.path = root / f"{PREFIX}{os.getpid()}-{staging.name.rsplit('-', 1)[-1]}"
        os.rename(staging, self.path)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def write(self, uuid: str, parts: Sequence[torch.Tensor], rows: int) -> Path:
        """Write (rows, sum of widths): each row is the main row then every level's, side by side. OSError as
        the file system raised it (ENOSPC for a full device); no temporary file is left either way."""
        path = self.path / file_name(uuid)
        temp = path.with_name(path.name + TEMP_SUFFIX)
        try:
            with open(temp, "wb") as f:
                for chunk in _row_chunks(parts, rows):
                    f.write(chunk)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return path

    def remove_temp(self) -> int:
        """Delete temporary files a writer left (one that failed mid-write and was restarted)."""
        left = list(self.path.glob(f"*{TEMP_SUFFIX}"))
        for temp in left:
            temp.unlink(missing_ok=True)
        return len(left)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)


def is_device_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _row_chunks(parts: Sequence[torch.Tensor], rows: int) -> Iterator[memoryview]:
    if len(parts) == 1:
        yield tensor_to_buffer(parts[0])  # no DeepStack: the frame's own bytes, no copy
        return
    row_bytes = sum(int(p.shape[1]) for p in parts) * parts[0].element_size()
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield tensor_to_buffer(torch.cat([p[start : start + step] for p in parts], dim=-1))  # (step, width)


def remove_orphans(root: Path, log: logging.Logger) -> None:
    """Remove every connector directory under root whose lock is free (/dev/shm is RAM, up to max_gb each)."""
    for candidate in [*root.glob(f"{PREFIX}*"), *root.glob(f"{STAGING}*")]:
        with contextlib.suppress(OSError):
            _remove_if_orphan(candidate, log)


def _remove_if_orphan(path: Path, log: logging.Logger) -> None:
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        if path.name.startswith(STAGING) and time.time() - path.stat().st_mtime < STAGING_S:
            return  # a store starting this very moment: its lock comes next
        shutil.rmtree(path, ignore_errors=True)  # no lock at all: an older vitserve's, or not a store's
        log.warning("vitserve connector: removed %s, a connector directory without a lock", path)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a live store holds it (in any process, any PID namespace)
        shutil.rmtree(path, ignore_errors=True)
        log.warning(
            "vitserve connector: removed %s, left by a connector that is gone (its lock was free)", path
        )
    finally:
        os.close(fd)


def read_entry(path: str, dtype: str, rows: int, width: int) -> torch.Tensor:
    """A held embedding as a CPU tensor of its own (the worker's side): one copy, read(2) straight into the
    tensor's memory (a large one in ranges read side by side: rpc/fileio.py), so the file may go at once and
    nothing of it stays mapped. torch.from_file(shared=False) would map the file copy-on-write instead: vLLM's
    encoder cache would then hold the deleted file's pages, and the connector's shared-memory device would never
    get its space back (on the CPU platform `.to()` of the same dtype is that very tensor). A file shorter than
    rows x width raises ValueError.

    The read holds a shared flock, and checks that `path` still names the file it opened: a file the connector
    let go may be recycled (pool.py), and vitserve writes one only under an exclusive flock, taken without waiting,
    after renaming it away from `path`. A file let go while this load raced its release raises FileNotFoundError,
    as it did when such a file was deleted."""
    tensor = _empty(rows, width, DTYPES[dtype])
    nbytes = tensor.numel() * tensor.element_size()
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    with open(path, "rb", buffering=0) as f:
        _still_held(f.fileno(), path)
        read_into(f.fileno(), view, lambda: _short(f.fileno(), path, nbytes, f"{rows} x {width} {dtype}"))
    return tensor


def _short(fd: int, path: str, nbytes: int, shape: str) -> ValueError:
    return ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, {nbytes} expected ({shape})")


def _still_held(fd: int, path: str) -> None:
    """Lock the open file shared; FileNotFoundError when vitserve is writing it or `path` names another file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        named, opened = os.stat(path), os.fstat(fd)
        same = (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
    except OSError:  # BlockingIOError: vitserve holds it; ENOENT: it went to the pool
        same = False
    if not same:
        raise FileNotFoundError(errno.ENOENT, "the connector let this file go while it was loaded", path)


def _empty(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor for read_entry. A large one is anonymous memory advised to use transparent huge pages: a fresh
    88.5 MB torch.empty costs ~21,600 page faults as read(2) fills it, and read_entry took 69-74 ms against 30-32 ms
    so (bench/handover_split.py, issue 51). The tensor keeps its mapping; it goes when the tensor goes, or is
    reused (_Buffers)."""
    nbytes = rows * width * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.empty(rows, width, dtype=dtype)
    return _BUFFERS.take(nbytes).view(dtype).reshape(rows, width)


class _Buffers:
    """The worker's huge-page buffers, each reused once every tensor made of it is gone (vLLM dropped it from its
    encoder cache, or on a GPU at once, after the copy to the device): a buffer whose pages are already there
    saves their faults and zeroing, 20 -> ~12 ms for 88.5 MB here (bench/handover_split.py). At most
    KEPT_BUFFERS are kept, so at most that many idle ones hold memory; a tensor's storage alive keeps its
    buffer's memory whatever this does (torch's weak reference says when it is gone)."""

    def __init__(self) -> None:
        self._kept: list[tuple[mmap.mmap, StorageWeakRef]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        with self._lock:
            free = [i for i, (_, ref) in enumerate(self._kept) if ref.expired()]  # type: ignore[no-untyped-call]
            same = [i for i in free if len(self._kept[i][0]) == size]
            buf = self._kept[same[0]][0] if same else _huge_pages(size)
            tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)  # (nbytes,)
            kept = (buf, StorageWeakRef(tensor.untyped_storage()))  # type: ignore[no-untyped-call]
            if same or free:  # the same buffer again, or one of another size let go for it
                self._kept[(same or free)[0]] = kept
            elif len(self._kept) < KEPT_BUFFERS:
                self._kept.append(kept)
            return tensor


def _huge_pages(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE (THP off): small pages, as before
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


_BUFFERS = _Buffers()
