"""--visual_mem_gb: the largest budget whose worst case fits a memory target (docs/engine.md, "A budget from a
memory target").

    res = size_for_memory(encoder, shape, knobs, lambda: fresh_meter(device), say=print)  # every rank of a group

1. Probe: the full-budget stress (stress.run_full) at budgets doubling from the family's smallest image (at
   least memory_model.MIN_PROBE_TOKENS), each measured as the reservation measures it: meter.py's published
   bytes (CPU: RSS growth x HEAP_FACTOR; CUDA: pool growth x POOL_FACTOR). Probing stops at the first probe
   above the target (out of memory counts), at one above CLOSE_ENOUGH of it or one that took
   SIZING_PROBE_TARGET_S once memory_model.MIN_PROBES are in, or at MAX_PROBES. (Stopping at half the target
   after a few tiny probes missed by far: a tiny tower's heap grew 38, 74, 103 MiB at 256, 512, 665 tokens,
   and a fit through the first three put 0.1 GiB at 778.)
2. Target (_target): between the largest run within the target and the next one over it, where the line
   between them crosses the target; with no run over it, where memory_model.fit (its quadratic term on every
   device) does, extrapolated at most EXTRAPOLATION times past proportional. Rounded down to the worst case's
   own tokens (a whole grid of merged patches; whole tiles), never below the smallest image.
3. Validate: the real full-budget stress at that budget, measured the same way. Over the target (or out of
   memory on a GPU): SHRINK of it, and again, at most MAX_SHRINKS times; then the probes' budgets that were
   within the target, largest first (_candidates); then MemoryTargetError, one line that names every knob.
   (Re-aiming from the failed runs instead was tried: on a tiny tower on a CPU the heap's noise, 15-30 MiB
   between runs of neighbouring budgets, made it chase the noise.)

Every decision is taken on values agreed over the TP group (stress.agree_max: the largest bytes, so every rank
sizes for the hungriest one and all choose the same budget).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vitserve.config import GIB, Config
from vitserve.errors import MemoryTargetError
from vitserve.model.base import Encoder
from vitserve.worker.reservation import memory_model, stress
from vitserve.worker.reservation.memory_model import MIN_PROBE_TOKENS, MIN_PROBES, Fit, Shape
from vitserve.worker.reservation.meter import Meter, meter_for
from vitserve.worker.reservation.record import Method, Reservation, StressShape
from vitserve.worker.reservation.worst_case import worst_case_units

log = logging.getLogger(__name__)

MAX_PROBES = 12  # 64 .. 131,072 tokens
# Stop doubling (and extrapolate) once a probe took this long; below it the probes go on until one is over the
# target. Higher than memory_model.RESERVATION_PROBE_TARGET_S: a tiny tower's probes take ~1 s on a loaded
# 2-core machine, and extrapolating from them missed (1. above).
SIZING_PROBE_TARGET_S = 10.0
# Stop doubling once a probe is above this share of the target. Probing past the target costs the longest run of
# all and, on a CPU, leaves a heap after which every smaller run reads more (a tiny tower: 512 tokens read 81 MiB
# as a probe and 105 MiB validated after a 2,048-token probe; 1,007 read over 0.2 GiB where 1,024 had read 0.174).
CLOSE_ENOUGH = 0.6
EXTRAPOLATION = 2.0  # the target is at most this times the budget proportional to the largest probe
MAX_BUDGET_TOKENS = 1 << 20
SHRINK = 0.95  # a failed validation tries this share of its budget next ...
MAX_SHRINKS = 3  # ... at most this many times (four validations in all), as in LightLLM's fix


@dataclass(frozen=True)
class Knobs:
    """What the diagnostic names: the target and every setting that moves the worst case or what it fits in."""

    target_gb: float  # --visual_mem_gb
    tp: int
    visual_infer_batch_size: int
    max_video_tokens: int
    dtype: str
    weights_bytes: int  # this rank's share of the tower's weights
    min_image_tokens: int  # the family's smallest image

    @property
    def target_bytes(self) -> int:
        return int(self.target_gb * GIB)

    @classmethod
    def of(cls, cfg: Config, encoder: Encoder, shape: StressShape) -> Knobs:
        assert cfg.visual_mem_gb is not None
        visual = getattr(encoder, "visual", None)
        params = visual.parameters() if isinstance(visual, torch.nn.Module) else ()
        weights = sum(p.numel() * p.element_size() for p in params)
        return cls(
            target_gb=cfg.visual_mem_gb,
            tp=cfg.tp,
            visual_infer_batch_size=cfg.visual_infer_batch_size,
            max_video_tokens=cfg.max_video_tokens,
            dtype=str(encoder.dtype).removeprefix("torch."),
            weights_bytes=int(stress.agree_max(float(weights), encoder.device)),
            min_image_tokens=max(1, shape.min_image_tokens or 1),
        )


@dataclass(frozen=True)
class Measured:
    """One full-budget stress at `budget`: its published bytes (inf: out of memory) and seconds."""

    budget: int
    bytes: float
    seconds: float


def size_for_memory(
    encoder: Encoder, shape: StressShape, knobs: Knobs, new_meter: Callable[[], Meter], say: stress.Progress
) -> Reservation:
    """Probe, target, validate (shrinking): the Reservation of the largest budget that fits, its budget_tokens
    set. Raises MemoryTargetError when none does.

    new_meter: a meter for each run, its baseline taken just before it (meter.py), so that each reads what a
    cold start at that budget would: what earlier runs left behind (oneDNN's kernels for their shapes, the
    CUDA pool's free blocks, given back first) is not counted as the next run's activations."""
    probes = _probe(encoder, shape, knobs, new_meter, say)
    tried: list[Measured] = []
    for budget in _candidates(encoder, shape, knobs, probes, tried):
        say(
            f"--visual_mem_gb {knobs.target_gb:g}: validating --visual_batch_max_tokens {budget} (try {len(tried) + 1})"
        )
        meter = new_meter()
        run = _stress(encoder, dataclasses.replace(shape, visual_batch_max_tokens=budget), meter)
        tried.append(run)
        if run.bytes <= knobs.target_bytes:
            meter.report()
            return _reservation(encoder, shape, knobs, run, meter, len(probes))
    raise MemoryTargetError(diagnostic(knobs, [*probes, *tried], "no budget fits it"))


def _candidates(
    encoder: Encoder, shape: StressShape, knobs: Knobs, probes: list[Measured], tried: list[Measured]
) -> Iterator[int]:
    """The budgets to validate, in order: the target, then SHRINK of the last, at most MAX_SHRINKS times
    (never below the smallest image); then the budgets probes already measured within the target, largest
    first. Those are for a growth with a step: on a CPU a tiny tower's stress read 74 MiB at 512 tokens and
    101-115 MiB at 570-666, so the target between 512 and 1,024 and three 5% shrinks all missed. More than
    one, because on a CPU a run after larger ones reads more than the same run did as a probe (glibc's heap is
    laid out anew: 512 tokens read 0.064 GiB as a probe and 0.104 GiB after a 1,024-token probe); each is half
    the one before, so walking down costs at most about one more run at the largest."""
    budget = _target(encoder, shape, knobs, probes)
    yield budget
    for _ in range(MAX_SHRINKS):
        smaller = _round(encoder, shape, knobs, int(budget * SHRINK))
        if smaller >= budget:  # already the smallest image: shrinking cannot help
            return
        budget = smaller
        yield budget
    done = {t.budget for t in tried}
    for fitted in sorted((p.budget for p in probes if p.bytes <= knobs.target_bytes), reverse=True):
        if fitted < budget and fitted not in done:
            yield fitted


def fresh_meter(device: torch.device) -> Meter:
    """A meter whose baseline is taken now; on CUDA after the pool's free blocks went back to the driver, so
    the growth an earlier, larger run left in the pool does not hide this run's (nor read as it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return meter_for(device)


def check_fits(knobs: Knobs, res: Reservation, budget: int, device: torch.device) -> None:
    """--visual_mem_gb beside --visual_batch_max_tokens: the flag's budget must fit the target (every rank
    of the group checks the largest reservation, so all refuse together)."""
    worst = stress.agree_max(float(res.bytes), device)
    if worst > knobs.target_bytes:
        measured = Measured(budget, worst, 0.0)
        raise MemoryTargetError(
            diagnostic(knobs, [measured], f"--visual_batch_max_tokens {budget} does not fit it")
        )


def diagnostic(knobs: Knobs, measured: list[Measured], what: str) -> str:
    """One line: the target, what was measured, every knob, and what to change."""
    peaks = ", ".join(f"{m.budget} tokens: {_gib(m.bytes)}" for m in sorted(measured, key=lambda m: m.budget))
    fitting = [m.budget for m in measured if m.bytes <= knobs.target_bytes]
    smallest = min(measured, key=lambda m: m.budget)
    change = (
        f"use --visual_batch_max_tokens {max(fitting)} or less, or raise --visual_mem_gb"
        if fitting
        else f"raise --visual_mem_gb above {_gib(smallest.bytes)}"
    )
    return (
        f"--visual_mem_gb {knobs.target_gb:g} per rank: {what} (measured peaks, as reserved: {peaks}; beside "
        f"{_gib(knobs.weights_bytes)} of weights; --tp {knobs.tp}, --visual_infer_batch_size "
        f"{knobs.visual_infer_batch_size}, --max_video_tokens {knobs.max_video_tokens}, --dtype {knobs.dtype}, the "
        f"family's smallest image {knobs.min_image_tokens} tokens); {change}, raise --tp, lower "
        "--visual_infer_batch_size, or use --dtype bfloat16 on a GPU"
    )


# ------------------------------------------------------------------------------------------------ steps


def _probe(
    encoder: Encoder, shape: StressShape, knobs: Knobs, new_meter: Callable[[], Meter], say: stress.Progress
) -> list[Measured]:
    """Full-budget stresses at doubling budgets, smallest first (1. in the module docstring)."""
    probes: list[Measured] = []
    budget = _round(encoder, shape, knobs, max(knobs.min_image_tokens, MIN_PROBE_TOKENS))
    while len(probes) < MAX_PROBES and budget <= MAX_BUDGET_TOKENS:
        probe = _stress(encoder, dataclasses.replace(shape, visual_batch_max_tokens=budget), new_meter())
        probes.append(probe)
        say(
            f"--visual_mem_gb {knobs.target_gb:g}: probe {len(probes)} at {budget} tokens: "
            f"{_gib(probe.bytes)} in {probe.seconds:.1f} s"
        )
        if probe.bytes > knobs.target_bytes:  # bracketed: the target lies below this probe
            break
        close = probe.bytes > knobs.target_bytes * CLOSE_ENOUGH
        if len(probes) >= MIN_PROBES and (close or probe.seconds >= SIZING_PROBE_TARGET_S):  # fit from here
            break
        bigger = _round(encoder, shape, knobs, budget * 2)
        if bigger <= budget:  # the worst case stops growing (InternVL: the batch-size cap)
            break
        budget = bigger
    return probes


def _target(encoder: Encoder, shape: StressShape, knobs: Knobs, runs: list[Measured]) -> int:
    """The largest budget the runs say fits (2. in the module docstring): between the largest run within the
    target and the next one over it, the line between them (the growth is convex, so its crossing is at or
    below the real one); with none over it, the fit's, extrapolated at most EXTRAPOLATION times past
    proportional; with none within it, the smallest image."""
    target = knobs.target_bytes
    over = [r for r in runs if r.bytes > target]
    within = [r for r in runs if r.bytes <= target and (not over or r.budget < min(o.budget for o in over))]
    if not within:
        return knobs.min_image_tokens
    low = max(within, key=lambda r: r.budget)
    if over:
        high = min(over, key=lambda r: r.budget)
        share = (target - low.bytes) / (high.bytes - low.bytes) if math.isfinite(high.bytes) else 0.0
        return _round(encoder, shape, knobs, int(low.budget + share * (high.budget - low.budget)))
    # Quadratic on CPU too (memory_model.memory_fit_is_quadratic says why the reservation's own fit is not):
    # these runs reach past half the target, so c is measured, not guessed from noise 1/128 of the way up.
    fit = memory_model.fit([(_shape(encoder, shape, r.budget), r.bytes) for r in runs], quadratic=True)
    cap = int(low.budget * max(1.0, EXTRAPOLATION * target / max(low.bytes, 1.0)))
    cap = min(max(cap, knobs.min_image_tokens), MAX_BUDGET_TOKENS)
    n = _largest_within(fit, lambda b: _shape(encoder, shape, b), target, low.budget, cap)
    return _round(encoder, shape, knobs, n)


def _largest_within(fit: Fit, at: Callable[[int], Shape], target: float, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] whose fitted bytes are within target (lo when none is): the fit grows with n."""
    if fit.at(at(hi)) <= target:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit.at(at(mid)) <= target else (lo, mid)
    return lo


def _stress(encoder: Encoder, shape: StressShape, meter: Meter) -> Measured:
    """The full-budget stress at shape's budget, measured as the reservation is: published bytes, agreed
    over the group (inf when a GPU ran out of memory)."""
    start = time.monotonic()
    try:
        nbytes = float(
            meter.published(meter.measure(lambda: stress.run_full(encoder, shape, lambda line: None)))
        )
    except torch.cuda.OutOfMemoryError:
        log.warning("out of memory at --visual_batch_max_tokens %d", shape.visual_batch_max_tokens)
        nbytes = math.inf
    seconds = stress.agree_max(time.monotonic() - start, encoder.device)
    return Measured(shape.visual_batch_max_tokens, stress.agree_max(nbytes, encoder.device), seconds)


def _shape(encoder: Encoder, shape: StressShape, budget: int) -> Shape:
    units, _ = worst_case_units(encoder, budget, shape.visual_infer_batch_size, **shape.bounds())
    return Shape.of_units(units)


def _round(encoder: Encoder, shape: StressShape, knobs: Knobs, budget: int) -> int:
    """Down to the tokens of the worst case at `budget` (a whole grid of merged patches; whole tiles), never
    below the smallest image."""
    budget = max(budget, knobs.min_image_tokens)
    return max(_shape(encoder, shape, budget).tokens, knobs.min_image_tokens)


def _reservation(
    encoder: Encoder, shape: StressShape, knobs: Knobs, run: Measured, meter: Meter, probes: int
) -> Reservation:
    units, images = worst_case_units(encoder, run.budget, shape.visual_infer_batch_size, **shape.bounds())
    detail = (
        f"sized for --visual_mem_gb {knobs.target_gb:g}: {probes} probes, the full-budget stress at "
        f"{run.budget} tokens measured {_gib(run.bytes)}"
    )
    log.info("--visual_mem_gb %g: budget %d tokens, %s", knobs.target_gb, run.budget, detail)
    return Reservation(
        int(run.bytes), Method.FULL, sum(units), images, detail, meter.baseline, budget_tokens=run.budget
    )


def _gib(nbytes: float) -> str:
    return "out of memory" if not math.isfinite(nbytes) else f"{nbytes / GIB:.3f} GiB"
