"""The connector's incoming area for the same-host hand-over (rpc/handoff.py says the messages): a directory
`incoming/` inside the store's locked directory (so on the same device: adopting a file is a rename), mode 0700,
and a host token beside it that only a process seeing this very directory can read.

Adopting a file checks, before anything of it is kept: its name (rpc/handoff.NAME: no path, no '..'), that it
opens without following a link (O_NOFOLLOW, relative to the directory's own descriptor) and without blocking (a
FIFO), that it is a regular file with one link (not a hard link to a file elsewhere), owned by this uid, of the
announced size, with the announced sampled checksum; then it is renamed to its digest name in the store's
directory and checked to be still the file that was checked. Whatever fails is a Refusal ("bad_file: ..."), and
the file under that name is removed: nothing is left behind. Files nobody announced are removed after
STALE_S (from their last write: vitserve touches a pool file it claims before it moves it here).

The pool of recycled files beside it (pool.py) is the incoming area's: `pool`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from vitserve.connector.checks import Refusal, Shape
from vitserve.connector.pool import Pool
from vitserve.rpc.handoff import NAME, SAMPLE_BYTES, FileEmbedding, Info, encode_info, sampled_crc
from vitserve.rpc.tensors import DTYPES

INCOMING = ".incoming"  # dot names: never a tensor's (64 hex characters)
TOKEN_NAME = ".host-token"
STALE_S = 60.0  # an incoming file older than this was never announced (its writer died): removed
_SWEEP_EVERY_S = 10.0


class Incoming:
    """`<store dir>/incoming` and the host token; `info`, `adopt`, `discard`, `sweep`; `pool` (pool.py)."""

    def __init__(self, store_dir: Path, dtype: str, width: int, max_bytes: int) -> None:
        self.path = store_dir / INCOMING
        self.path.mkdir(mode=0o700)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self.token = secrets.token_hex(16)
        self.token_file = store_dir / TOKEN_NAME
        self.token_file.write_text(self.token)
        self.dtype, self.width = dtype, width
        self.pool = Pool(store_dir, max_bytes)
        self._swept = time.monotonic()

    def info(self, query_id: str) -> bytes:
        return encode_info(
            Info(
                query_id,
                str(self.path),
                str(self.token_file),
                self.token,
                self.dtype,
                self.width,
                SAMPLE_BYTES,
            )
        )

    def adopt(self, m: FileEmbedding, dest: Path) -> Path:
        """Make `m`'s file `dest` (in the store's directory), checked; Refusal (and the file removed) otherwise."""
        if not NAME.fullmatch(m.name):
            raise Refusal(
                "bad_file", f"file name {m.name[:80]!r} is not one of the incoming area's (in-<32 hex>)"
            )
        try:
            self._adopt(m, dest)
        except BaseException:
            self.discard(m.name)
            raise
        return dest

    def _adopt(self, m: FileEmbedding, dest: Path) -> None:
        try:
            fd = os.open(m.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self._fd)
        except OSError as exc:  # missing, a symbolic link (ELOOP), ...
            raise Refusal("bad_file", f"{m.name} cannot be opened in {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            self._check(m, st)
            if sampled_crc(fd, m.nbytes, m.sample) != m.crc:
                raise Refusal("bad_file", f"{m.name}: its sampled checksum is not the announced {m.crc}")
            os.rename(m.name, dest, src_dir_fd=self._fd)
            if os.stat(dest, follow_symlinks=False).st_ino != st.st_ino:  # replaced after the checks
                dest.unlink(missing_ok=True)
                raise Refusal("bad_file", f"{m.name} was replaced while it was checked")
        finally:
            os.close(fd)

    def _check(self, m: FileEmbedding, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise Refusal("bad_file", f"{m.name} is not a regular file with one link")
        if st.st_uid != os.getuid():
            raise Refusal("bad_file", f"{m.name} belongs to uid {st.st_uid}, not to this connector's")
        if st.st_size != m.nbytes:
            raise Refusal("bad_file", f"{m.name} holds {st.st_size} bytes, {m.nbytes} announced")

    def discard(self, name: str) -> None:
        if NAME.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)

    def sweep(self) -> None:
        """Remove incoming files older than STALE_S (at most every _SWEEP_EVERY_S)."""
        if time.monotonic() - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = time.monotonic()
        for entry in os.scandir(self._fd):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_S:
                    os.unlink(entry.name, dir_fd=self._fd)

    def close(self) -> None:
        os.close(self._fd)


def check_file(m: FileEmbedding, shape: Shape, now: float) -> tuple[int, int, int]:
    """(rows, width, nbytes) of a file message, from its numbers alone, as checks.check_message."""
    if m.expires_at <= now:
        raise Refusal("expired", f"expired {now - m.expires_at:.3f} s ago")
    t, h, w = m.grid_thw
    merge = shape.merge
    if m.rows == 0 or m.rows != t * h * w // (merge * merge) or (h % merge) or (w % merge):
        raise Refusal("shape", f"{m.rows} rows, but grid {list(m.grid_thw)} with merge {merge} needs "
                               f"{t * h * w // merge**2}")  # fmt: skip
    if m.width == 0 or (shape.width and m.width != shape.width):
        raise Refusal("shape", f"width {m.width}, but this model needs {shape.width}")
    nbytes = m.rows * m.width * DTYPES[m.dtype].itemsize
    if nbytes != m.nbytes:
        raise Refusal("bad_file", f"{m.nbytes} bytes announced, {m.rows} x {m.width} {m.dtype} is {nbytes}")
    return m.rows, m.width, nbytes
