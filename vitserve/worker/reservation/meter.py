"""Measuring activation memory: the growth a few runs cause over one baseline taken before the first.

- CUDA: `reset_peak_memory_stats`, the run, then the larger of the growth of `max_memory_reserved` over the
  pool before the stress and the peak of `max_memory_allocated` over what was allocated before (weights
  were resident before; the second covers activations served from blocks the pool already had). No
  `empty_cache`: the peak stays in the caching allocator for the life of the process, which is what makes
  it a reservation.
- CPU: peak RSS growth. Free heap pages go back to the OS first (glibc `malloc_trim(0)`), so that memory
  left free by loading or earlier forwards does not hide part of the worst case; then the kernel's
  high-water mark is reset (`echo 5 > /proc/self/clear_refs`) and the growth is `VmHWM` after the runs
  minus `VmRSS` before them (both from /proc/self/status). If the reset is not allowed, `VmHWM` may stay at
  an older, higher peak and the growth reads 0; the meter then falls back to the growth of `ru_maxrss`,
  which has the same blind spot, and logs it. With vitserve.model.fast_alloc's setting (no mmap for large
  blocks, no trimming, one arena) the heap keeps that peak afterwards, like CUDA's pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
from collections.abc import Callable
from pathlib import Path

import torch

from vitserve.worker.reservation import stored

log = logging.getLogger(__name__)

# CPU: published bytes per byte of the full stress's RSS growth. glibc's heap fragments differently from run to
# run and over batches of other compositions, so the peak while serving ends above the stress's own (in steps
# of one batch's pixels; on the tiny towers, where those are a large share, by up to about three quarters:
# bench/reservation.py). Over-reserving host RAM costs little; under-reserving breaks docs/design.md's
# invariant 7.
HEAP_FACTOR = 2.0
# CUDA: published bytes per byte of the full stress's pool growth. The caching allocator reuses its blocks, but
# batches of other compositions can still need segments the pool lacks: with the Qwen2.5-VL-7B-shaped tower at
# 16,384 tokens, serving grew the pool to 1.004-1.006 times the stress's growth (H100 and H200; bench/RESULTS.md,
# "On a GPU (H100)"). The pool keeps the growth; the tenth above it is published but left free on the device,
# where the pool can grow into it: held as one large block it could not serve the segments that grew (the
# H200 run that held it exceeded it by the same 16 MiB).
POOL_FACTOR = 1.1
HOLD_MAX_BLOCKS = 256  # CudaMeter.hold: at most this many allocations (each one a free block, or growth)


class Meter:
    """Measures the activation memory of a few runs against one baseline taken before the first."""

    baseline = 0  # bytes: CPU RSS / CUDA pool when the meter was made
    factor = 1.0  # published bytes per measured byte

    def measure(self, run: Callable[[], None]) -> int:
        raise NotImplementedError

    def hold(self, nbytes: int) -> int:
        """Make sure `nbytes` over the baseline are held (CUDA: in the pool); returns nbytes."""
        return nbytes

    def published(self, growth: int) -> int:
        """The bytes to publish for the full stress's measured growth: times the device's factor."""
        return int(growth * self.factor)

    def report(self) -> None:
        """Log what the growth was counted from, once the stress is over."""


def meter_for(device: torch.device | str) -> Meter:
    dev = torch.device(device)
    return CudaMeter(dev) if dev.type == "cuda" else CpuMeter()


class CudaMeter(Meter):
    """Pool growth over the pool after loading; published times POOL_FACTOR (the growth stays in the pool)."""

    factor = POOL_FACTOR

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        torch.cuda.synchronize(dev)
        self.reserved_before = self.baseline = torch.cuda.memory_reserved(dev)
        self.allocated_before = torch.cuda.memory_allocated(dev)

    def measure(self, run: Callable[[], None]) -> int:
        torch.cuda.reset_peak_memory_stats(self.dev)
        run()
        torch.cuda.synchronize(self.dev)
        peak_alloc = torch.cuda.max_memory_allocated(self.dev) - self.allocated_before
        held = torch.cuda.max_memory_reserved(self.dev) - self.reserved_before
        log.info("stress peak: allocated +%d bytes, allocator pool +%d bytes (kept)", peak_alloc, held)
        return max(held, peak_alloc)

    def hold(self, nbytes: int) -> int:
        """Grow the pool to `nbytes` over the baseline. One allocation of the shortfall is not enough: after
        the stress the pool has free blocks, and the allocator serves it from one of them without growing.
        So blocks of the shortfall are taken, all live at once, until the pool has grown (each one the pool
        serves from its free blocks occupies one of them), then freed into the pool."""
        blocks: list[torch.Tensor] = []
        while len(blocks) < HOLD_MAX_BLOCKS:
            short = self.reserved_before + nbytes - torch.cuda.memory_reserved(self.dev)
            if short <= 0:
                break
            blocks.append(torch.empty(short, dtype=torch.uint8, device=self.dev))
        del blocks
        return nbytes


class CpuMeter(Meter):
    """Peak RSS growth over the RSS after loading, free heap returned first; published times HEAP_FACTOR."""

    factor = HEAP_FACTOR

    def __init__(self) -> None:
        _release_free_heap()
        _reset_rss_peak()  # from here on VmHWM is the peak after loading (what PeakWatch compares)
        self.rss_before = proc_status_kib("VmRSS")
        self.baseline = (self.rss_before or 0) * 1024
        self.maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        self.hwm = 0  # KiB, the highest VmHWM a measured run reached
        self.heap_growth = 0  # bytes: glibc's heap extent (mallinfo2 arena + hblkhd) grown by the last run

    def measure(self, run: Callable[[], None]) -> int:
        _release_free_heap()
        reset = _reset_rss_peak()
        extent = heap_extent()
        run()
        self.heap_growth = max(heap_extent() - extent, 0)  # beside RSS, for bench/reservation.py
        hwm = proc_status_kib("VmHWM")
        if reset and hwm is not None and self.rss_before is not None:
            self.hwm = max(self.hwm, hwm)
            return max(hwm - self.rss_before, 0) * 1024
        log.warning("could not reset the RSS high-water mark; the CPU reservation may read low")
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.maxrss_before, 0) * 1024

    def report(self) -> None:
        if self.hwm:  # the baseline, so a test (or an operator) can check runtime peaks against it
            log.info("CPU stress: VmRSS %d KiB before, VmHWM %d KiB after", self.rss_before, self.hwm)


def live_peak(device: torch.device) -> int:
    """The process's peak so far, in the units of a meter's baseline (CPU: VmHWM; CUDA: the pool's peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    hwm = proc_status_kib("VmHWM")
    return 0 if hwm is None else hwm * 1024


def hold_in_cuda_pool(device: torch.device | str, nbytes: int) -> None:
    """CUDA: allocate and free `nbytes` into the caching allocator, so the pool holds them for the life of the
    process (no empty_cache). Elsewhere nothing: a CPU reservation is a published number."""
    dev = torch.device(device)
    if dev.type == "cuda" and nbytes > 0:
        block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del block


def _release_free_heap() -> None:
    """Give free heap pages back to the OS first (glibc malloc_trim), so the RSS growth counts the whole
    worst case and not only what the heap lacked after earlier work (loading, a previous forward)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth may read low
        pass


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc >= 2.33 malloc.h, every field a size_t
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_extent() -> int:
    """glibc's heap extent (mallinfo2: arena + hblkhd), 0 where mallinfo2 is missing. With vitserve.model.fast_alloc's
    setting it never shrinks between forwards, so its growth over a run is what the heap had to add for it: the
    allocator's own count, which no page-level accounting (and no other process) moves."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.arena + info.hblkhd)


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0) so the next read is the peak of what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakWatch:
    """After each batch: is the live peak still within the published bytes? Cheap (one /proc read on CPU,
    one allocator counter on CUDA); warns and invalidates the cache entry once, the first time it is not."""

    def __init__(self, device: torch.device, baseline: int, published: int, cache_file: Path | None):
        self.device, self.baseline, self.published, self.cache_file = device, baseline, published, cache_file
        self.exceeded = False

    def check(self) -> None:
        if self.exceeded:
            return
        growth = live_peak(self.device) - self.baseline
        if growth <= self.published:
            return
        self.exceeded = True
        log.warning(
            "live memory peak %d bytes above the start-up baseline exceeds the %d bytes reserved; the stored "
            "reservation is dropped so the next start measures again (or set --visual_reserved_mem_gb)",
            growth,
            self.published,
        )
        if self.cache_file is not None:
            stored.invalidate(self.cache_file)
