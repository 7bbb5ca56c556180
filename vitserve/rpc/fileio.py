"""Large tensors to and from files in shared memory at the speed the kernel allows (issue 51's same-host
hand-over; bench/handover_split.py measures each).

What tmpfs does with 88.5 MB on this project's machine (AMD EPYC x 2, /dev/shm, bench/RESULTS.md "The hand-over
split copy by copy"): memcpy 5.5-7 ms; write(2) over an existing file 14-15 ms, whatever the number of threads
(a tmpfs write holds the inode's lock, so writers of one file take turns); read(2) 10.5 ms in one thread and
6.3 ms in two (reads of one file run side by side). So `read_into` reads a large file in up to READ_THREADS
ranges at once. Writes stay one pass in one thread (rpc/handoff.py `write_rows`): overlapping the cast into each
chunk with the write of the chunk before it was tried and measured slower (best 18.8-19.6 ms against 17.0-18.1,
medians 22 against 17-19, alternating in one sitting): the two passes share the memory bus and the two cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

READ_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
PARALLEL_MIN_BYTES = 16 << 20  # below this one thread: a range costs more to hand over than it saves
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's threads (a forked child, as vLLM's workers may be, gets its own: a parent's pool has no
    threads there)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools.clear()
        _pools[pid] = ThreadPoolExecutor(max(2, READ_THREADS), thread_name_prefix="vitserve-fileio")
    return _pools[pid]


def read_into(fd: int, view: memoryview, on_short: Callable[[], Exception]) -> None:
    """Fill `view` (bytes) from the open file's start; `on_short()` is raised when the file ends first."""
    n = view.nbytes
    ranges = READ_THREADS if n >= PARALLEL_MIN_BYTES else 1
    step = -(-n // ranges)
    if ranges == 1:
        _read_range(fd, view, 0, on_short)
        return
    futures = [_pool().submit(_read_range, fd, view[a : a + step], a, on_short) for a in range(0, n, step)]
    _settle(futures)


def _read_range(fd: int, view: memoryview, offset: int, on_short: Callable[[], Exception]) -> int:
    done = 0
    while done < view.nbytes:  # preadv returns at most ~2 GiB at a time
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise on_short()
        done += got
    return done


def _settle(futures: list[Future[int]]) -> None:
    """Wait for all of them, then raise the first failure: no read outlives the call."""
    first: BaseException | None = None
    for f in futures:
        exc = f.exception()
        first = first or exc
    if first is not None:
        raise first
