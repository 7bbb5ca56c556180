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
import dataclasses
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitserve.config import GIB, Config
from vitserve.errors import ConfigError
from vitserve.families import DISABLED_BUDGET_TOKENS, FAMILIES
from vitserve.model.base import Encoder
from vitserve.worker import memory_model
from vitserve.worker.worst_case import (
    stress_batch_count,
    stress_batches,
    worst_case_items,
    worst_case_units,
)

log = logging.getLogger(__name__)

# CPU only: the published bytes are the stress's RSS growth times (1 + this). The runtime peak after READY ends
# above the stress growth by up to about one more growth, in steps of one batch's pixel bytes: glibc's heap
# fragments differently from run to run (tests/integration/test_memory_full_budget.py; bench/RESULTS.md, "The
# CPU heap margin"). Over-reserving host RAM on a CPU-only server costs little; under-reserving breaks
# docs/design.md invariant 7. CUDA's caching allocator shows no such drift
# (tests/unit/test_reservation.py) and gets no margin.
CPU_HEAP_MARGIN = 1.0


@dataclass(frozen=True)
class Reservation:
    bytes: int  # activation memory of the worst case (CUDA: max of pool and allocated-peak growth; CPU: RSS growth)
    source: str  # "stress" | "override"
    tokens: int = 0  # image tokens in the stressed batch (0 for an override)
    images: int = 0  # images in the stressed batch
    method: str = "override"  # "full" (the full-budget stress) | "extrapolated" (memory_model) | "override"
    detail: str = ""  # which shapes were measured, for the log
    baseline: int = 0  # what the bytes are counted from: CPU RSS / CUDA pool before the stress (PeakWatch)
    cached: bool = False  # taken from the reservation cache, no stress ran


@dataclass(frozen=True)
class StressShape:
    """What bounds a batch: the flags, and what the processor allows per image (see worst_case.py)."""

    budget_tokens: int
    max_batch_images: int
    max_tiles_per_image: int | None = None  # InternVL: the processor's max_patches + 1
    max_image_tokens: int | None = None  # the processor's largest image; defines budget 0

    def bounds(self) -> dict[str, int | None]:
        return {"max_tiles_per_image": self.max_tiles_per_image, "max_image_tokens": self.max_image_tokens}


def stress_shape(config: Config, family: str) -> StressShape:
    """The flags' bounds, plus the processor's per-image limits where the worst case needs them: budget 0
    (the largest image the processor emits) and InternVL (max tiles per image). Loading the processor here
    costs an import of the HF image processors, so only those cases do it."""
    shape = StressShape(config.budget_tokens, config.max_batch_images)
    layout = getattr(FAMILIES.get(family), "layout", None)
    if config.budget_tokens > 0 and layout != "tiles":
        return shape
    from vitserve.processors import load_image_processor

    info = load_image_processor(
        config.model, config.budget_tokens, family=config.model_family, resize=config.image_resize
    ).clamp_info()
    if layout == "tiles":
        tiles = int(info["max_patches"]) + (1 if int(info["max_patches"]) > 1 else 0)  # + the thumbnail
        return dataclasses.replace(
            shape, max_tiles_per_image=tiles, max_image_tokens=tiles * int(info["tokens_per_tile"])
        )
    factor = int(info["patch_size"]) * int(info["merge_size"])
    return dataclasses.replace(shape, max_image_tokens=int(info["max_pixels"]) // factor**2)


Progress = Callable[[str], None]  # one line per step of the stress, for the operator (stderr)


def reserve(
    encoder: Encoder,
    *,
    budget_tokens: int,
    max_batch_images: int,
    override_gb: float | None,
    max_tiles_per_image: int | None = None,
    max_image_tokens: int | None = None,
    progress: Progress | None = None,
    fast_enough_s: float = memory_model.FULL_STRESS_MAX_S,
) -> Reservation:
    """Measure the worst case (the full-budget stress, or the memory model where that is slow), or honour the
    override, and return what is held.

    max_tiles_per_image / max_image_tokens: what the processor allows per image, see StressShape.
    fast_enough_s: run the full stress when the probes predict it takes at most this (0: always extrapolate
    where the budget allows probes, as the tests of the model do).
    """
    if override_gb is not None:
        return _reserve_override(encoder.device, override_gb)
    shape = StressShape(budget_tokens, max_batch_images, max_tiles_per_image, max_image_tokens)
    say = progress or (lambda line: None)
    meter = _meter(encoder)
    units, images = worst_case_units(encoder, budget_tokens, max_batch_images, **shape.bounds())
    full = memory_model.Shape.of_units(units)
    tokens = full.tokens
    est = memory_model.estimate(
        _probe_scale(shape),
        full,
        lambda b: _probe(encoder, meter, shape, b, say),
        fast_enough_s=fast_enough_s,
        quadratic_memory=memory_model.memory_fit_is_quadratic(torch.device(encoder.device).type),
    )
    if est is None:
        nbytes = meter.measure(lambda: _run_full(encoder, shape, say))
        method, detail = "full", f"the full-budget stress ({tokens} tokens in {images} images)"
    else:
        nbytes = meter.hold(est.reserved_bytes)
        method, detail = "extrapolated", memory_model.describe(est)
    nbytes = meter.finish(nbytes)
    log.info(
        "reserved %d bytes for the worst case (%d tokens in %d images): %s", nbytes, tokens, images, detail
    )
    return Reservation(nbytes, "stress", tokens, images, method, detail, meter.baseline)


def adopt(encoder: Encoder, stored: Reservation) -> Reservation:
    """A reservation measured by an earlier start under the same key (reservation_cache): hold it (CUDA) and
    count the live peak from now."""
    meter = _meter(encoder)
    meter.hold(stored.bytes)
    return dataclasses.replace(stored, baseline=meter.baseline, cached=True)


def _probe_scale(shape: StressShape) -> int:
    """What the probes are fractions of: the budget, or with budget 0 the processor's largest image (the
    worst case is then max_batch_images of those, and the model's linear term carries the count)."""
    if shape.budget_tokens > 0:
        return shape.budget_tokens
    return shape.max_image_tokens or DISABLED_BUDGET_TOKENS


def _probe(
    encoder: Encoder, meter: _Meter, shape: StressShape, budget: int, say: Progress
) -> memory_model.Probe:
    units, _ = worst_case_units(encoder, budget, shape.max_batch_images, **shape.bounds())
    probe_shape = memory_model.Shape.of_units(units)
    start = time.monotonic()

    def run() -> None:
        # built inside the measured window: at runtime a batch's pixels are live during its forward too
        encoder.encode(worst_case_items(encoder, budget, shape.max_batch_images, **shape.bounds()))

    nbytes = meter.measure(run)
    seconds = agree_max(time.monotonic() - start, encoder.device)  # every TP rank decides alike
    planned = memory_model.probe_budgets(_probe_scale(shape))
    k = planned.index(budget) + 1 if budget in planned else len(planned)
    eta = sum(seconds * 2**j for j in range(1, max(memory_model.MIN_PROBES - k, 0) + 1))
    say(
        f"stress: shape {k} of up to {len(planned)} ({probe_shape.tokens} tokens) took {seconds:.1f} s, "
        f"{nbytes / 2**20:.0f} MiB; ETA {eta:.0f} s"
    )
    return memory_model.Probe(budget, probe_shape, nbytes, seconds)


def agree_max(value: float, device: torch.device | str) -> float:
    """The largest `value` over the ranks of this tensor-parallel group (the value itself at TP 1).

    Every rank of a group runs each stress forward together (the TP layers' collectives), so each decision
    that picks forwards (run the full stress or extrapolate, add a probe, use the stored reservation) must
    come out the same on every rank: it is taken on values agreed this way, not on one rank's own timing.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return value
    dev = torch.device(device)
    t = torch.tensor([value], dtype=torch.float64, device=dev if dev.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _run_full(encoder: Encoder, shape: StressShape, say: Progress) -> None:
    count = stress_batch_count(encoder, shape.budget_tokens, shape.max_batch_images)
    start = time.monotonic()
    batches = stress_batches(encoder, shape.budget_tokens, shape.max_batch_images, **shape.bounds())
    for k, items in enumerate(batches, 1):
        # Batches are built inside the measured window: at runtime a batch's pixel tensors are live in the
        # worker during its forward too, so on CPU they belong to the peak.
        tokens = sum(it.num_tokens for it in items)
        encoder.encode(items)
        del items  # one batch live at a time, as in the worker loop
        left = (time.monotonic() - start) / k * (count - k)
        say(f"stress: full-budget batch {k}/{count} ({tokens} tokens) done, ETA {left:.0f} s")


def _reserve_override(device: torch.device | str, override_gb: float) -> Reservation:
    if override_gb < 0:
        raise ConfigError(f"--visual_reserved_mem_gb must be >= 0, got {override_gb}")
    nbytes = int(override_gb * GIB)
    hold_in_cuda_pool(device, nbytes)
    return Reservation(bytes=nbytes, source="override")


def hold_in_cuda_pool(device: torch.device | str, nbytes: int) -> None:
    """CUDA: allocate and free `nbytes` into the caching allocator, so the pool holds them for the life of the
    process (no empty_cache). Elsewhere nothing: a CPU reservation is a published number."""
    dev = torch.device(device)
    if dev.type == "cuda" and nbytes > 0:
        block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del block


class _Meter:
    """Measures the activation memory of a few runs against one baseline taken before the first."""

    baseline = 0  # bytes: CPU RSS / CUDA pool when the meter was made

    def measure(self, run: Callable[[], None]) -> int:
        raise NotImplementedError

    def hold(self, nbytes: int) -> int:
        """Make sure `nbytes` over the baseline are held (CUDA: in the pool); returns nbytes."""
        return nbytes

    def finish(self, nbytes: int) -> int:
        """The bytes to publish for a measured (or predicted) growth."""
        return nbytes


def _meter(encoder: Encoder) -> _Meter:
    dev = torch.device(encoder.device)
    return _CudaMeter(dev) if dev.type == "cuda" else _CpuMeter()


class _CudaMeter(_Meter):
    """`reset_peak_memory_stats`, the run, then the larger of the growth of `max_memory_reserved` over the pool
    before the first run and the peak of `max_memory_allocated` over what was allocated before."""

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
        held = torch.cuda.memory_reserved(self.dev) - self.reserved_before
        hold_in_cuda_pool(self.dev, nbytes - held)
        return nbytes


class _CpuMeter(_Meter):
    """Peak RSS growth over the RSS after loading (free heap returned first), plus CPU_HEAP_MARGIN."""

    def __init__(self) -> None:
        _release_free_heap()
        _reset_rss_peak()  # from here on VmHWM is the peak after loading (what PeakWatch compares)
        self.rss_before = proc_status_kib("VmRSS")
        self.baseline = (self.rss_before or 0) * 1024
        self.hwm = 0  # KiB, the highest VmHWM a measured run reached
        self.maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def measure(self, run: Callable[[], None]) -> int:
        _release_free_heap()
        reset = _reset_rss_peak()
        run()
        hwm = proc_status_kib("VmHWM")
        if reset and hwm is not None and self.rss_before is not None:
            self.hwm = max(self.hwm, hwm)
            return max(hwm - self.rss_before, 0) * 1024
        log.warning("could not reset the RSS high-water mark; the CPU reservation may read low")
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.maxrss_before, 0) * 1024

    def finish(self, nbytes: int) -> int:
        if self.hwm:  # once: the baseline, so a test (or an operator) can check runtime peaks against it
            log.info("CPU stress: VmRSS %d KiB before, VmHWM %d KiB after", self.rss_before, self.hwm)
        return _with_heap_margin(nbytes)


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


def proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None
