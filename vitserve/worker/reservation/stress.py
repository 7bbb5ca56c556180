"""Worst-case memory reservation: run the production forward on the worst-case batches and keep the peak.

At start-up every rank runs the production `encoder.encode` on the batch that maximises activation memory
under the token budget (and, around it, other full-budget compositions: see stress_batches), keeps that
peak in the allocator, and publishes the number so that an LLM server sharing the device sizes its KV cache
after it. Nothing here allocates buffers production never allocates: the stress is a few `encode` calls on
batches the scheduler can form, one live at a time.

The batches: worst_case.py. How memory is measured: meter.py. Where the full forward is slow, the
worst case is extrapolated from smaller ones: memory_model.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from vitserve.config import GIB
from vitserve.errors import ConfigError
from vitserve.families import DISABLED_BUDGET_TOKENS
from vitserve.model.base import Encoder
from vitserve.worker.reservation import memory_model
from vitserve.worker.reservation.meter import Meter, hold_in_cuda_pool, meter_for
from vitserve.worker.reservation.record import Method, Reservation, StressShape
from vitserve.worker.reservation.worst_case import (
    stress_batch_count,
    stress_batches,
    worst_case_items,
    worst_case_units,
)

log = logging.getLogger(__name__)

Progress = Callable[[str], None]  # one line per step of the stress, for the operator (stderr)


def measure(
    encoder: Encoder,
    shape: StressShape,
    *,
    progress: Progress | None = None,
    fast_enough_s: float = memory_model.FULL_STRESS_MAX_S,
) -> Reservation:
    """Measure the worst case under `shape`: the full-budget stress, or the memory model where that is slow.

    fast_enough_s: run the full stress when the probes predict it takes at most this (0: always extrapolate
    where the budget allows probes, as the tests of the model do).
    """
    say = progress or (lambda line: None)
    meter = meter_for(encoder.device)
    units, images = worst_case_units(
        encoder, shape.visual_batch_max_tokens, shape.visual_infer_batch_size, **shape.bounds()
    )
    full = memory_model.Shape.of_units(units)
    est = memory_model.estimate(
        _probe_scale(shape),
        full,
        lambda b: _probe(encoder, meter, shape, b, say),
        fast_enough_s=fast_enough_s,
        quadratic_memory=memory_model.memory_fit_is_quadratic(torch.device(encoder.device).type),
    )
    if est is None:
        # CPU: x HEAP_FACTOR; CUDA: x POOL_FACTOR, the pool keeping the growth and the rest left free (meter.py)
        nbytes = meter.published(meter.measure(lambda: run_full(encoder, shape, say)))
        method, detail = Method.FULL, f"the full-budget stress ({full.tokens} tokens in {images} images)"
    else:
        nbytes = meter.hold(est.reserved_bytes)  # x MODEL_FACTOR, which bounds the serving peak itself
        method, detail = Method.EXTRAPOLATED, memory_model.describe(est)
    meter.report()
    log.info(
        "reserved %d bytes for the worst case (%d tokens in %d images): %s",
        nbytes,
        full.tokens,
        images,
        detail,
    )
    return Reservation(nbytes, method, full.tokens, images, detail, meter.baseline)


def adopt(encoder: Encoder, stored: Reservation, where: str) -> Reservation:
    """A reservation measured by an earlier start under the same key (cache.py): hold it (CUDA) and count
    the live peak from now."""
    meter = meter_for(encoder.device)
    meter.hold(stored.bytes)
    detail = f"stored in {where}: {stored.method.value}, {stored.detail}"
    return dataclasses.replace(stored, method=Method.STORED, detail=detail, baseline=meter.baseline)


def override(device: torch.device | str, override_gb: float) -> Reservation:
    """--visual_reserved_mem_gb: held in the CUDA pool; on CPU a published number."""
    if override_gb < 0:
        raise ConfigError(f"--visual_reserved_mem_gb must be >= 0, got {override_gb}")
    nbytes = int(override_gb * GIB)
    hold_in_cuda_pool(device, nbytes)
    return Reservation(nbytes, Method.OVERRIDE)


def _probe_scale(shape: StressShape) -> int:
    """What the probes are fractions of: the budget, or with budget 0 the processor's largest image (the
    worst case is then visual_infer_batch_size of those, and the model's linear term carries the count)."""
    if shape.visual_batch_max_tokens > 0:
        return shape.visual_batch_max_tokens
    return shape.max_image_tokens or DISABLED_BUDGET_TOKENS


def _probe(
    encoder: Encoder, meter: Meter, shape: StressShape, budget: int, say: Progress
) -> memory_model.Probe:
    units, _ = worst_case_units(encoder, budget, shape.visual_infer_batch_size, **shape.bounds())
    probe_shape = memory_model.Shape.of_units(units)
    start = time.monotonic()

    def run() -> None:
        # built inside the measured window: at runtime a batch's pixels are live during its forward too
        encoder.encode(worst_case_items(encoder, budget, shape.visual_infer_batch_size, **shape.bounds()))

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


def run_full(encoder: Encoder, shape: StressShape, say: Progress) -> None:
    """The full-budget stress: every batch of stress_batches through the production forward, one at a time."""
    count = stress_batch_count(encoder, shape.visual_batch_max_tokens, shape.visual_infer_batch_size)
    start = time.monotonic()
    batches = stress_batches(
        encoder, shape.visual_batch_max_tokens, shape.visual_infer_batch_size, **shape.bounds()
    )
    for k, items in enumerate(batches, 1):
        # Batches are built inside the measured window: at runtime a batch's pixel tensors are live in the
        # worker during its forward too, so on CPU they belong to the peak.
        tokens = sum(it.num_tokens for it in items)
        encoder.encode(items)
        del items  # one batch live at a time, as in the worker loop
        left = (time.monotonic() - start) / k * (count - k)
        say(f"stress: full-budget batch {k}/{count} ({tokens} tokens) done, ETA {left:.0f} s")
