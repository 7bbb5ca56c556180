"""Freed video chunks go back to the OS: glibc's mmap threshold pinned (docs/video.md "Memory").

glibc's malloc serves blocks above its mmap threshold (128 KiB at start) with mmap, and each time such a block
is freed it raises the threshold to that block's size, up to 32 MiB. After the first few chunks of a video,
a chunk's frames and pixels (a few MiB each) therefore come from the heap, and what is freed there stays in
the process as fragmentation: the API process grew by about 1.8 MiB per temporal group made, though every
chunk was freed (measured with bench/video_memory.py's chunks in one process). Setting the threshold once turns the adjustment off, so
every block of a chunk's size is mmapped and unmapped again when freed, and memory stays flat with a
video's length. Other allocators (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from 1 MiB up are mmapped: a frame of 640x480 RGB and up


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES for this process; False where it is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
