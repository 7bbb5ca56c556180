"""Worst-case memory reservation: run the production forward on the worst-case batches and keep the peak.


At start-up every rank runs the production `encoder.encode` on the batch that maximises activation memory
under the token budget (and, around it, other full-budget compositions: see stress_batches), keeps that
peak in the allocator, and publishes the number so that an LLM server sharing the device sizes its KV cache
after it. Nothing here allocates buffers production never allocates: the stress is a few `encode` calls on
batches the scheduler can form, one live at a time.

The batches: vitserve/worker/worst_case.py. The published file: vitserve/reservation_file.py.

Measurement:
- CUDA: `reset_peak_memory_stats`, one `encode`, then the larger of the growth of `max_memory_reserved`
  over the pool before the stress and the peak of `max_memory_allocated` over what was allocated before
  (weights were resident before; the second covers activations served from blocks the pool already had).
  No `empty_cache`: the peak stays in the caching allocator for the life of the process, which is what
  makes it a reservation.
- CPU: peak RSS growth. We first return free heap pages to the OS (glibc `malloc_trim(0)`), so that memory
  left free by loading or earlier forwards does not hide part of the worst case; then reset the kernel's
  high-water mark (`echo 5 > /proc/self/clear_refs`) and read
  `VmHWM` after the forwards minus `VmRSS` before them (both from /proc/self/status), plus CPU_HEAP_MARGIN. If the reset is not
  allowed, `VmHWM` may stay at an older, higher peak and the growth reads 0; we then fall back to the
  growth of `ru_maxrss`, which has the same blind spot, and log it. With vitserve.model.fast's allocator
  setting (no mmap for large blocks, no trimming) the heap keeps that peak afterwards, like CUDA's pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitserve.config import GIB
from vitserve.errors import ConfigError
from vitserve.model.base import Encoder
from vitserve.worker.worst_case import stress_batches

log = logging.getLogger(__name__)

# CPU only: the published bytes are the stress's RSS growth times (1 + this). Measured with
# tests/integration/test_memory_l3.py (tiny Qwen2-VL, budget 1024, 60 full-budget batches of six
# compositions after READY, one arena, the multi-batch stress): over 5 runs the runtime peak ended 0-63%
# above the stress growth (61.6 -> 100.1 MiB at worst), in steps of one batch's pixel bytes (19 MiB): glibc's
# heap fragments differently from run to run. Over-reserving host RAM on a CPU-only server costs little;
# under-reserving is what L3 forbids. CUDA's caching allocator shows no such drift
# (tests/unit/test_reservation.py) and gets no margin.
CPU_HEAP_MARGIN = 1.0


@dataclass(frozen=True)
class Reservation:
    bytes: int  # activation memory of the worst case (CUDA: max of pool and allocated-peak growth; CPU: RSS growth)
    source: str  # "stress" | "override"
    tokens: int = 0  # image tokens in the stressed batch (0 for an override)
    images: int = 0  # images in the stressed batch


def reserve(
    encoder: Encoder,
    *,
    budget_tokens: int,
    max_batch_images: int,
    override_gb: float | None,
    max_tiles_per_image: int | None = None,
) -> Reservation:
    """Run the production forward on the worst case (or honour the override) and return what is held.

    max_tiles_per_image: InternVL only, see worst_case_items.
    """
    if override_gb is not None:
        return _reserve_override(encoder.device, override_gb)
    shape: list[int] = []  # (tokens, images) of the worst-case batch, filled in by run()

    def run() -> None:
        # Batches are built inside the measured window: at runtime a batch's pixel tensors are live in the
        # worker during its forward too, so on CPU they belong to the peak.
        for items in stress_batches(
            encoder, budget_tokens, max_batch_images, max_tiles_per_image=max_tiles_per_image
        ):
            if not shape:
                shape[:] = [sum(i.num_tokens for i in items), len(items)]
            encoder.encode(items)
            del items  # one batch live at a time, as in the worker loop

    if torch.device(encoder.device).type == "cuda":
        nbytes = _stress_cuda(torch.device(encoder.device), run)
    else:
        nbytes = _stress_cpu(run)
    log.info("reserved %d bytes for the worst case (%d tokens in %d images)", nbytes, *shape)
    return Reservation(bytes=nbytes, source="stress", tokens=shape[0], images=shape[1])


def _reserve_override(device: torch.device | str, override_gb: float) -> Reservation:
    if override_gb < 0:
        raise ConfigError(f"--visual_reserved_mem_gb must be >= 0, got {override_gb}")
    nbytes = int(override_gb * GIB)
    dev = torch.device(device)
    if dev.type == "cuda" and nbytes > 0:
        # Allocate and free into the caching allocator: the block stays held by this process (no empty_cache).
        block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del block
    return Reservation(bytes=nbytes, source="override")


def _stress_cuda(dev: torch.device, run: Callable[[], None]) -> int:
    torch.cuda.synchronize(dev)
    reserved_before = torch.cuda.memory_reserved(dev)
    allocated_before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    torch.cuda.synchronize(dev)
    peak_alloc = torch.cuda.max_memory_allocated(dev) - allocated_before
    held = torch.cuda.max_memory_reserved(dev) - reserved_before
    log.info(
        "stress peak: allocated +%d bytes, allocator pool +%d bytes (kept, no empty_cache)", peak_alloc, held
    )
    return max(held, peak_alloc)


def _stress_cpu(run: Callable[[], None]) -> int:
    _release_free_heap()
    reset = _reset_rss_peak()
    rss_before = _proc_status_kib("VmRSS")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    run()
    hwm = _proc_status_kib("VmHWM")
    if reset and hwm is not None and rss_before is not None:
        # The baseline is logged so that a test (or an operator) can check runtime peaks against it.
        log.info("CPU stress: VmRSS %d KiB before, VmHWM %d KiB after", rss_before, hwm)
        return _with_heap_margin(max(hwm - rss_before, 0) * 1024)
    log.warning("could not reset the RSS high-water mark; the CPU reservation may read low")
    return _with_heap_margin(
        max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before, 0) * 1024
    )


def _with_heap_margin(growth: int) -> int:
    """The measured growth plus CPU_HEAP_MARGIN of it: glibc's heap fragments differently from run to run
    (the zmq, liveness and torch threads allocate concurrently), so the same full-budget batches can end a
    few tens of MiB above a peak measured once. See CPU_HEAP_MARGIN for the numbers."""
    return int(growth * (1 + CPU_HEAP_MARGIN))


def _release_free_heap() -> None:
    """Give free heap pages back to the OS first (glibc malloc_trim), so the RSS growth counts the whole
    worst case and not only what the heap lacked after earlier work (loading, a previous forward)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth may read low
        pass


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0) so the next read is the peak of what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None
