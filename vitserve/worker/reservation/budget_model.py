"""The model behind --visual_mem_gb: the worst case's memory against the budget, from measured full-budget stresses
(docs/engine.md, "A budget from a memory target"), the largest budget it says fits, and the record that keeps it.

    model = Model(record.points, shape_of)          # shape_of(budget): the worst case's Shape at that budget
    budget, bound = model.largest_within(target, floor, ceiling)

The model is U(b) = max(F(b), E(b)): F is memory_model.fit (a + b*n + c*sum(n_i^2), b, c >= 0) over every finite
point, the largest reading of each budget; E is the largest reading at any budget <= b (a stress that measured m
at b says every larger budget costs at least m; a stress out of memory makes E infinite from there). Both only
grow with b, so U does, and for one set of points the largest budget within G grows with G: larger targets never
give smaller budgets. The points are what a start measured, kept in the Record with every start's decision; the
Record is refined (points and decisions added), never replaced, and the decisions bound a new one
(Record.bracket), which keeps the decisions of every start that shares it monotone whatever the meter read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from vitserve.worker.reservation import memory_model
from vitserve.worker.reservation.memory_model import Shape

# What bound a chosen budget: the target itself; the model's ceiling (no more than CEILING_FACTOR times the
# largest budget measured); the largest worst case there is (it stops growing with the budget: a per-image or
# per-batch maximum); or an earlier start's decision in the record (the bracket).
Bound = Literal["visual_mem_gb", "model_ceiling", "per_image_max", "earlier_start"]
CEILING_FACTOR = 8  # the model extrapolates at most this times past the largest budget measured


@dataclass(frozen=True)
class Point:
    """One full-budget stress at `budget`: its published bytes (inf: out of memory)."""

    budget: int
    tokens: int  # the worst case's image tokens at that budget
    squares: int  # the sum of its attention units' tokens squared
    bytes: float
    kind: str = "probe"  # probe (a fixed shape) or validation (a chosen budget)

    @property
    def shape(self) -> Shape:
        return Shape(self.tokens, self.squares)


@dataclass(frozen=True)
class Decision:
    """A start's result: the budget chosen for target_gb and what its stress published (<= the target)."""

    target_gb: float
    budget: int
    bytes: int


@dataclass
class Record:
    """Everything measured for one key (the weights, device, shape bounds; not the target), and every decision."""

    points: list[Point] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def measured(self, budget: int) -> bool:
        return any(p.budget == budget for p in self.points)

    def bracket(self, target_gb: float) -> tuple[Decision | None, Decision | None]:
        """The decisions that bound a new one for target_gb: the largest budget decided for a target at most
        it (a budget never smaller: it fitted less) and the smallest decided for one at least it (never larger).
        """
        below = [d for d in self.decisions if d.target_gb <= target_gb]
        above = [d for d in self.decisions if d.target_gb >= target_gb]
        low = max(below, key=lambda d: d.budget, default=None)
        high = min(above, key=lambda d: d.budget, default=None)
        return low, high

    def to_json(self) -> dict[str, Any]:
        points = [{**asdict(p), "bytes": p.bytes if math.isfinite(p.bytes) else None} for p in self.points]
        return {"points": points, "decisions": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Record:
        """The inverse of to_json; raises KeyError, ValueError or TypeError on a malformed body."""
        points = []
        for p in body["points"]:
            nbytes = math.inf if p["bytes"] is None else float(p["bytes"])
            points.append(
                Point(int(p["budget"]), int(p["tokens"]), int(p["squares"]), nbytes, str(p["kind"]))
            )
        decisions = [
            Decision(float(d["target_gb"]), int(d["budget"]), int(d["bytes"])) for d in body["decisions"]
        ]
        return cls(points, decisions)


class Model:
    """U(b) = max(F(b), E(b)) over the points (module docstring); shape_of(b) is the worst case at budget b."""

    def __init__(self, points: Sequence[Point], shape_of: Callable[[int], Shape]) -> None:
        self.shape_of = shape_of
        largest: dict[int, Point] = {}
        for p in points:
            if p.budget not in largest or p.bytes > largest[p.budget].bytes:
                largest[p.budget] = p
        self.points = sorted(largest.values(), key=lambda p: p.budget)
        finite = [(p.shape, p.bytes) for p in self.points if math.isfinite(p.bytes)]
        self.fit = memory_model.fit(finite, quadratic=True) if finite else memory_model.Fit(0.0, 0.0, 0.0)

    def at(self, budget: int) -> float:
        """The predicted published bytes of the full-budget stress at `budget`."""
        envelope = max((p.bytes for p in self.points if p.budget <= budget), default=0.0)
        return max(self.fit.at(self.shape_of(budget)), envelope)

    @property
    def ceiling(self) -> int:
        """The largest budget the model speaks for: CEILING_FACTOR times the largest budget measured."""
        return CEILING_FACTOR * max((p.budget for p in self.points), default=0)

    def largest_within(self, target: float, floor: int, ceiling: int) -> tuple[int, Bound]:
        """The largest budget in [floor, ceiling] whose prediction is within target (floor when none is; the
        caller validates it), and what bound it. U grows with the budget, so bisection finds it."""
        top = min(ceiling, self.ceiling) if self.ceiling >= floor else floor
        if self.at(top) <= target:  # ceiling: the largest worst case there is (the caller's)
            return top, "model_ceiling" if top < ceiling else "per_image_max"
        lo, hi = floor, top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.at(mid) <= target else (lo, mid)
        return lo, "visual_mem_gb"
