"""Keep large CPU tensors in the heap instead of fresh mmap pages.

glibc serves every allocation above 32 MiB (its mmap threshold cap) with a fresh mmap and unmaps it on
free, so each large activation of a packed forward (8k tokens x 1376 floats = 45 MB) page-faults on
first touch. Measured here: Linear(512->1376)+SiLU on 8100 tokens, 0.33 s -> 0.16 s per call once mmap is off.
With mmap off and trimming off, freed blocks are reused by the next forward, like CUDA's caching
allocator: the process keeps its peak, which is what the start-up reservation measures anyway.

One arena (M_ARENA_MAX 1): a worker's batch arrives in frames that zmq's I/O thread allocates, and glibc gives
each thread an arena of its own, so a retained main-thread peak could not serve them and each thread's arena
would keep a peak of its own on top (measured, tiny Qwen2-VL at 1024 tokens: +19 MiB, one batch's pixels, on
the first runtime batch after the start-up stress, ~+40 MiB after 60). The worker sets this before it starts
any thread (worker/process.py run_worker); threads that already hold an arena keep it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # bytes; never give the top of the heap back between forwards

_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Turn off glibc's mmap for large blocks and heap trimming, and use one arena, once per process.

    Returns True when the setting is active (glibc found and accepted it), False elsewhere (macOS, musl).
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not sys.platform.startswith("linux"):
        return _tuned
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return _tuned
    _tuned = (
        bool(mallopt(_M_MMAP_MAX, 0))
        and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )
    log.info("glibc large-block mmap %s for the CPU encoder", "disabled" if _tuned else "left as is")
    return _tuned
