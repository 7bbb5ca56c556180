"""--visual_mem_gb: the largest budget whose worst case fits a memory target (docs/engine.md, "A budget from a
memory target").

    res = size_for_memory(encoder, shape, knobs, lambda: fresh_meter(device), say, record)  # every rank of a group

The search is budget_search.py's (probe fixed budgets, choose from the model of budget_model.py, validate,
shrink), run here on the production forward: each run is the full-budget stress (stress.run_full) at a budget,
measured as the reservation measures it: meter.py's published bytes (CPU: RSS growth x HEAP_FACTOR; CUDA: pool
growth x POOL_FACTOR), from a fresh meter's baseline, agreed over the TP group (stress.agree_max: the largest
bytes, so every rank sizes for the hungriest one and all choose the same budget). The record (budget_model.Record)
is the rank's model record, stored by reserve.py between starts; the result says why (Reservation.sizing: the
target, the model's prediction, the probes behind it, and which limit bound the budget).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitserve.config import GIB, Config
from vitserve.errors import MemoryTargetError
from vitserve.model.base import Encoder
from vitserve.worker.reservation import budget_search, stress
from vitserve.worker.reservation.budget_model import CEILING_FACTOR, Record
from vitserve.worker.reservation.budget_search import Outcome
from vitserve.worker.reservation.memory_model import Shape
from vitserve.worker.reservation.meter import Meter, meter_for
from vitserve.worker.reservation.record import Method, Reservation, StressShape
from vitserve.worker.reservation.worst_case import worst_case_units

log = logging.getLogger(__name__)

SHRINK = budget_search.SHRINK  # after a validation over the target, the next is at most this share of it


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
    encoder: Encoder,
    shape: StressShape,
    knobs: Knobs,
    new_meter: Callable[[], Meter],
    say: stress.Progress,
    record: Record | None = None,
) -> Reservation:
    """The Reservation of the largest budget that fits (budget_search.search), its budget_tokens and sizing set;
    `record` (the rank's model record, empty when None) gains this start's runs and decision. Raises
    MemoryTargetError when no budget fits.

    new_meter: a meter for each run, its baseline taken just before it (meter.py), so that each reads what a
    cold start at that budget would: what earlier runs left behind (oneDNN's kernels for their shapes, the
    CUDA pool's free blocks, given back first) is not counted as the next run's activations."""
    record = record if record is not None else Record()
    before = len(record.points)
    runs = EncoderRuns(encoder, shape, knobs, new_meter)
    prefix = f"--visual_mem_gb {knobs.target_gb:g}: "
    outcome = budget_search.search(knobs.target_gb, record, runs, lambda line: say(prefix + line))
    if outcome is None:
        measured = [Measured(p.budget, p.bytes, 0.0) for p in record.points[before:]] or [
            Measured(p.budget, p.bytes, 0.0) for p in record.points
        ]
        raise MemoryTargetError(diagnostic(knobs, measured, "no budget fits it"))
    res = _reservation(encoder, shape, knobs, outcome, new_meter())
    say(res.detail)  # the start-up line that says why: G, the prediction, the probes, the bound
    return res


class EncoderRuns:
    """budget_search.Runs on the production forward: the full-budget stress at a budget, measured (module
    docstring)."""

    def __init__(self, encoder: Encoder, shape: StressShape, knobs: Knobs, new_meter: Callable[[], Meter]):
        self.encoder, self.stress_shape, self.knobs, self.new_meter = encoder, shape, knobs, new_meter
        self.floor = _round(encoder, shape, knobs, knobs.min_image_tokens)
        self.ceiling = _round(encoder, shape, knobs, budget_search.MAX_BUDGET_TOKENS)

    def shape(self, budget: int) -> Shape:
        return _shape(self.encoder, self.stress_shape, budget)

    def round(self, budget: int) -> int:
        return _round(self.encoder, self.stress_shape, self.knobs, budget)

    def measure(self, budget: int) -> float:
        run = _stress(
            self.encoder,
            dataclasses.replace(self.stress_shape, visual_batch_max_tokens=budget),
            self.new_meter(),
        )
        return run.bytes

    def agree_min(self, value: int) -> int:
        return int(-stress.agree_max(-float(value), self.encoder.device))


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
    encoder: Encoder, shape: StressShape, knobs: Knobs, out: Outcome, meter: Meter
) -> Reservation:
    """The chosen budget's reservation: its stress's bytes, held from a fresh baseline (CUDA: in the pool; a
    larger run tried after it, or the pool's free blocks, are not what is published)."""
    units, images = worst_case_units(encoder, out.budget, shape.visual_infer_batch_size, **shape.bounds())
    meter.hold(int(out.bytes))
    detail = (
        f"budget {out.budget} tokens, its stress {_gib(out.bytes)}"
        f"{' (an earlier start measured it)' if out.stored else ''}; the model predicted "
        f"{_gib(out.predicted)} there from {len(out.probes)} measured budgets ({_budgets(out.probes)}), "
        f"{out.validations} validated now; bound by {BOUND_WORDS[out.bound]}"
    )
    log.info("--visual_mem_gb %g: %s", knobs.target_gb, detail)
    method = Method.STORED if out.stored else Method.FULL
    return Reservation(
        int(out.bytes),
        method,
        sum(units),
        images,
        f"--visual_mem_gb {knobs.target_gb:g}: {detail}",
        meter.baseline,
        budget_tokens=out.budget,
        sizing=out.why(knobs.target_gb),
    )


BOUND_WORDS = {
    "visual_mem_gb": "--visual_mem_gb (a larger budget is predicted or measured over it)",
    "model_ceiling": f"the model's ceiling ({CEILING_FACTOR}x the largest budget measured)",
    "per_image_max": "the largest worst case (the per-image and per-batch maximum)",
    "earlier_start": "an earlier start's decision in the model record",
}


def _budgets(budgets: tuple[int, ...]) -> str:
    return ", ".join(map(str, budgets)) if len(budgets) <= 8 else f"{budgets[0]} .. {budgets[-1]}"


def _gib(nbytes: float) -> str:
    return "out of memory" if not math.isfinite(nbytes) else f"{nbytes / GIB:.3f} GiB"
