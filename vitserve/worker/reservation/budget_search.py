"""--visual_mem_gb's search over a model (budget_model.py): probe, target, validate, shrink. Pure: it runs the
stresses through a Runs (sizing.py's runs the production forward on the worst case; the unit tests run synthetic
meters), so that what makes it monotone can be tested on any meter.

    outcome = search(target, record, runs, say)   # None: nothing fits (sizing.py raises MemoryTargetError)

1. Probe: the full-budget stress at PROBES fixed budgets, doubling from the family's smallest image (at least
   memory_model.MIN_PROBE_TOKENS), each measured once per Record: a budget the record holds is not measured
   again. No time cap: the points do not depend on how busy the machine is. Probing stops at the first above
   CLOSE_ENOUGH of the target, or when the worst case stops growing: a probe past the target costs the longest
   run of all and, on a CPU, leaves a heap after which every smaller run reads more (a tiny tower whose probes
   went on to 2,048 tokens chose 512 and 1,024 for 0.1 and 0.2 GiB where 603 and 1,137 fitted).
2. Target: the largest budget the model says fits, within the bracket of earlier decisions (Record.bracket).
3. Validate: the full-budget stress there; its reading becomes a point. Within the target: kept, and when the
   model, refined by it, says more than STEP_UP larger fits, that is validated next. Over it: the model's new
   choice, at most SHRINK of the failed budget. At most MAX_VALIDATIONS stresses in all.
4. The largest budget validated within the target; else the larger of the earlier decision below it (the
   bracket's low end, which fitted a smaller target) and the largest run within the target; else None.

Every value that picks a stress is agreed over the TP group (Runs.agree_min), so the ranks choose alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vitserve.worker.reservation.budget_model import Bound, Decision, Model, Point, Record
from vitserve.worker.reservation.memory_model import MIN_PROBE_TOKENS, Shape

PROBES = 6  # fixed budgets: 64 .. 2,048 tokens for a family whose smallest image is below 64
MAX_VALIDATIONS = 4  # full-budget stresses at chosen budgets, as LightLLM's fix validates (1 + 3 shrinks)
CLOSE_ENOUGH = 0.6  # probing stops at the first probe above this share of the target
SHRINK = 0.95  # after a validation over the target the next one is at most this share of it
STEP_UP = 0.05  # after one within it, the next is tried only when the model says this much more fits
MAX_BUDGET_TOKENS = 1 << 20


class Runs(Protocol):
    """The stresses a search runs: the worst case's shape at a budget, one measured run, and TP agreement."""

    floor: int  # the smallest budget (the family's smallest image)
    ceiling: int  # the budget of the largest worst case there is (it stops growing above it)

    def shape(self, budget: int) -> Shape: ...

    def round(self, budget: int) -> int:
        """Down to the worst case's own tokens at `budget` (never below floor)."""
        ...

    def measure(self, budget: int) -> float:
        """The published bytes of the full-budget stress at `budget`, agreed over the group (inf: out of memory)."""
        ...

    def agree_min(self, value: int) -> int: ...


@dataclass(frozen=True)
class Outcome:
    """What the search chose and why (the start-up line and /v1/info show it)."""

    budget: int
    bytes: float  # what its stress published (<= the target)
    predicted: float  # the model's bytes at the budget when it was chosen
    bound: Bound
    probes: tuple[int, ...]  # the budgets of the points behind the model
    validations: int  # stresses at chosen budgets in this start
    stored: bool = False  # an earlier start's decision (the bracket's low end), not measured now

    def why(self, target_gb: float) -> dict[str, object]:
        return {
            "visual_mem_gb": target_gb,
            "predicted_bytes": int(self.predicted) if math.isfinite(self.predicted) else None,
            "measured_bytes": int(self.bytes),
            "bound": self.bound,
            "probes": list(self.probes),
            "validations": self.validations,
        }


def search(target_gb: float, record: Record, runs: Runs, say: Callable[[str], None]) -> Outcome | None:
    """Probe, target, validate (module docstring). Adds every run to `record`, and the decision."""
    target = target_gb * 2**30
    probe(target, record, runs, say)
    low, high = (_agreed(runs, d) for d in record.bracket(target_gb))
    before = len(record.points)
    best = _validate(target, record, runs, say, low, high)
    if best is None:
        best = _fallback(target, record, runs, low, high)
        tried = sum(1 for p in record.points[before:] if p.kind == "validation")
        best = dataclasses.replace(best, validations=tried) if best is not None else None
    if best is not None:
        record.decisions.append(Decision(target_gb, best.budget, int(best.bytes)))
    return best


def probe(target: float, record: Record, runs: Runs, say: Callable[[str], None]) -> None:
    """The fixed probes the record lacks, smallest first, until one is above CLOSE_ENOUGH of the target."""
    budget = runs.round(max(runs.floor, MIN_PROBE_TOKENS))
    for k in range(1, PROBES + 1):
        have = [p for p in record.points if p.budget == budget]
        if runs.agree_min(int(bool(have))) == 0:  # any rank lacks it: the group measures it
            point = _run(runs, budget, "probe")
            record.points.append(point)
            have = [point]
            say(f"probe {k} of {PROBES} at {budget} tokens: {_gib(point.bytes)}")
        if max(p.bytes for p in have) > target * CLOSE_ENOUGH:
            return
        bigger = runs.round(budget * 2)
        if bigger <= budget:  # the worst case stops growing
            return
        budget = bigger


def _validate(
    target: float,
    record: Record,
    runs: Runs,
    say: Callable[[str], None],
    low: Decision | None,
    high: Decision | None,
) -> Outcome | None:
    best: Outcome | None = None
    failed = math.inf  # the smallest budget validated over the target
    done = 0
    for tries in range(1, MAX_VALIDATIONS + 1):
        model = Model(record.points, runs.shape)
        budget, bound, predicted = _choose(model, target, runs, high, failed)
        if budget >= failed or (low is not None and budget <= low.budget):
            break
        if best is not None and budget <= best.budget * (1 + STEP_UP):
            break
        say(f"validating --visual_batch_max_tokens {budget} (try {tries})")
        point = _run(runs, budget, "validation")
        record.points.append(point)
        done = tries
        if point.bytes <= target:
            probes = tuple(p.budget for p in model.points)
            best = Outcome(budget, point.bytes, predicted, bound, probes, tries)
        else:
            failed = min(failed, budget)
    return dataclasses.replace(best, validations=done) if best is not None else None


def _choose(
    model: Model, target: float, runs: Runs, high: Decision | None, failed: float
) -> tuple[int, Bound, float]:
    """The model's largest budget within the target, at most the bracket's high end and SHRINK of a failure."""
    cap = runs.ceiling
    if high is not None:
        cap = min(cap, high.budget)
    if math.isfinite(failed):
        cap = min(cap, runs.round(int(failed * SHRINK)))
    budget, bound = model.largest_within(target, runs.floor, min(cap, MAX_BUDGET_TOKENS))
    if bound == "per_image_max" and cap < runs.ceiling:  # the cap bound it, not the largest worst case
        bound = "earlier_start" if high is not None and cap == high.budget else "visual_mem_gb"
    budget = runs.agree_min(runs.round(budget))
    return budget, bound, model.at(budget)


def _fallback(
    target: float, record: Record, runs: Runs, low: Decision | None, high: Decision | None
) -> Outcome | None:
    """No validation passed: the larger of the earlier decision below (it fitted a smaller target) and the
    largest run within the target (at most the bracket's high end); None when there is neither."""
    model = Model(record.points, runs.shape)
    probes = tuple(p.budget for p in model.points)
    cap = high.budget if high is not None else MAX_BUDGET_TOKENS
    fits = [p for p in model.points if p.bytes <= target and p.budget <= cap]
    best = max(fits, key=lambda p: p.budget, default=None)
    if low is not None and (best is None or low.budget >= best.budget):
        return Outcome(low.budget, low.bytes, model.at(low.budget), "earlier_start", probes, 0, stored=True)
    if best is None:
        return None
    return Outcome(best.budget, best.bytes, model.at(best.budget), "visual_mem_gb", probes, 0)


def _agreed(runs: Runs, decision: Decision | None) -> Decision | None:
    """The decision when every rank of the group holds the same one (their records are written alike), else
    None on every rank: ranks must validate the same budgets together."""
    value = decision.budget if decision is not None else -1
    return decision if runs.agree_min(value) == -runs.agree_min(-value) else None


def _run(runs: Runs, budget: int, kind: str) -> Point:
    shape = runs.shape(budget)
    return Point(budget, shape.tokens, shape.squares, runs.measure(budget), kind)


def _gib(nbytes: float) -> str:
    return "out of memory" if not math.isfinite(nbytes) else f"{nbytes / 2**30:.3f} GiB"
