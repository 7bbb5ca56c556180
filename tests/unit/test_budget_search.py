"""--visual_mem_gb's search on synthetic meters (vitserve/worker/reservation/budget_search.py, budget_model.py): more
memory never gives a smaller budget, whatever the meter reads (noise, outliers, a probe out of memory, a meter
that drifts from start to start as a loaded machine's does); each budget's stress is within its target; on a
meter without noise the budget is within 10% of the largest that fits. Real ranks run it in
tests/integration/test_visual_mem_gb.py; bench/reservation.py measures it against bisection."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from vitserve.worker.reservation import budget_search
from vitserve.worker.reservation.budget_model import Model, Point, Record
from vitserve.worker.reservation.memory_model import Shape

MIB = 2**20


@dataclass
class SyntheticRuns:
    """budget_search.Runs with a meter that reads base + slope*n + curve*n^2 (bytes, n tokens), times noise, with
    outliers and budgets out of memory; budgets are multiples of 4 (a grid), at least 4."""

    slope: float = 0.2 * MIB
    curve: float = 2.0
    base: float = 20 * MIB
    noise: float = 0.0  # each reading times 1 + uniform(-noise, noise)
    outliers: frozenset[int] = frozenset()  # budgets whose reading is doubled
    out_of_memory: frozenset[int] = frozenset()  # budgets whose run fails (inf)
    seed: int = 0
    floor: int = 4
    ceiling: int = budget_search.MAX_BUDGET_TOKENS
    measured: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def true_bytes(self, budget: int) -> float:
        return self.base + self.slope * budget + self.curve * budget * budget

    def shape(self, budget: int) -> Shape:
        return Shape.of_units([self.round(budget)])

    def round(self, budget: int) -> int:
        return max(self.floor, min(budget, self.ceiling) // 4 * 4)

    def measure(self, budget: int) -> float:
        self.measured.append(budget)
        if budget in self.out_of_memory:
            return math.inf
        reading = self.true_bytes(budget) * (1 + self.rng.uniform(-self.noise, self.noise))
        return reading * 2 if budget in self.outliers else reading

    def agree_min(self, value: int) -> int:
        return value

    def largest_fitting(self, target: float) -> int:
        """The largest budget whose noise-free reading is within target (bisection on the true curve)."""
        lo, hi = self.floor, self.ceiling
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.true_bytes(mid) <= target else (lo, mid)
        return self.round(lo)


def _search(target_gb: float, record: Record, runs: SyntheticRuns) -> budget_search.Outcome | None:
    return budget_search.search(target_gb, record, runs, lambda line: None)


PROBE_BUDGETS = [64, 128, 256, 512, 1024, 2048]
budgets = st.sampled_from([*PROBE_BUDGETS, 3000, 5000, 8000, 12000, 20000])
meters = st.builds(
    SyntheticRuns,
    slope=st.floats(0.01 * MIB, 1.0 * MIB),
    curve=st.floats(0.0, 50.0),
    noise=st.floats(0.0, 0.3),
    outliers=st.frozensets(budgets, max_size=2),
    out_of_memory=st.frozensets(budgets, max_size=1),
    seed=st.integers(0, 2**16),
)
targets = st.lists(st.floats(0.05, 8.0), min_size=2, max_size=5)


@settings(max_examples=150, deadline=None)
@given(meter=meters, gbs=targets, drift=st.floats(0.0, 0.5))
def test_starts_that_share_a_record_never_give_more_memory_a_smaller_budget(meter, gbs, drift):
    """Any order of targets, one record (the warm-start record in --runtime_dir), and the meter reading more or
    less from start to start (a machine whose load changes): the decisions are monotone, and each published
    reservation is within its target."""
    record = Record()
    decided: list[tuple[float, int]] = []
    for k, gb in enumerate(gbs):
        scale = 1 + drift * math.sin(k * 2.1)  # this start's meter reads this much more (or less)
        start = SyntheticRuns(
            meter.slope * scale, meter.curve * scale, meter.base, meter.noise, meter.outliers,
            meter.out_of_memory, seed=meter.seed + k,
        )  # fmt: skip
        out = _search(gb, record, start)
        if out is None:
            continue
        assert out.bytes <= gb * 2**30, (gb, out)
        decided.append((gb, out.budget))
    for gb, budget in decided:
        for other_gb, other in decided:
            if other_gb > gb:
                assert other >= budget, (decided, gb, other_gb)


@settings(max_examples=150, deadline=None)
@given(meter=meters, gbs=targets)
def test_one_set_of_points_gives_budgets_that_grow_with_the_target(meter, gbs):
    """The model alone (no bracket, no validation): U(b) = max(fit, envelope) grows with b, so its largest budget
    within G grows with G, whatever the points read."""
    points = [Point(b, b, b * b, meter.measure(b)) for b in PROBE_BUDGETS]
    model = Model(points, meter.shape)
    chosen = [model.largest_within(gb * 2**30, 4, 1 << 20)[0] for gb in sorted(gbs)]
    assert chosen == sorted(chosen)


@settings(max_examples=60, deadline=None)
@given(slope=st.floats(0.05 * MIB, 1.0 * MIB), curve=st.floats(0.0, 50.0), gb=st.floats(0.5, 6.0))
def test_without_noise_the_budget_is_within_10_percent_of_the_largest_that_fits(slope, curve, gb):
    runs = SyntheticRuns(slope=slope, curve=curve)
    out = _search(gb, Record(), runs)
    largest = runs.largest_fitting(gb * 2**30)
    assert out is not None
    assert 0.9 * largest <= out.budget <= largest, (out, largest)


def test_the_probes_are_fixed_budgets_measured_once_per_record():
    runs = SyntheticRuns()
    record = Record()
    _search(4.0, record, runs)
    assert runs.measured[: budget_search.PROBES] == PROBE_BUDGETS
    again = SyntheticRuns(noise=0.2, seed=3)  # a later start, another reading: the probes are in the record
    _search(6.0, record, again)
    assert not set(again.measured) & set(PROBE_BUDGETS)


def test_probing_stops_at_the_first_probe_above_60_percent_of_the_target():
    runs = SyntheticRuns(slope=1.0 * MIB, curve=0.0)  # 64 tokens: 0.082 GiB, 128: 0.145
    out = _search(0.2, Record(), runs)
    assert runs.measured[:2] == [64, 128]
    assert all(128 < b < 256 for b in runs.measured[2:])
    assert out is not None
    assert 128 <= out.budget < 256


def test_a_probe_out_of_memory_bounds_the_budget_below_it():
    runs = SyntheticRuns(out_of_memory=frozenset({1024}))
    out = _search(50.0, Record(), runs)
    assert out is not None
    assert 512 <= out.budget < 1024
    assert out.bound == "visual_mem_gb"


def test_a_target_nothing_fits_gives_none():
    assert _search(0.001, Record(), SyntheticRuns()) is None  # 20 MiB before the first token


def test_the_same_target_again_reuses_the_decision_without_a_stress():
    record = Record()
    first = _search(2.0, record, SyntheticRuns())
    runs = SyntheticRuns(noise=0.3, seed=9)
    again = _search(2.0, record, runs)
    assert first is not None
    assert again is not None
    assert (again.budget, again.bound, again.stored) == (first.budget, "earlier_start", True)
    assert runs.measured == []


def test_why_names_the_target_the_prediction_the_probes_and_the_bound():
    out = _search(2.0, Record(), SyntheticRuns())
    assert out is not None
    why = out.why(2.0)
    assert why["visual_mem_gb"] == 2.0
    assert why["bound"] == "visual_mem_gb"
    assert why["probes"][: budget_search.PROBES] == PROBE_BUDGETS
    assert isinstance(why["predicted_bytes"], int)
    assert 0 < why["measured_bytes"] <= 2 * 2**30


def test_the_largest_worst_case_bounds_a_target_larger_than_it():
    out = _search(8.0, Record(), SyntheticRuns(ceiling=4096))
    assert out is not None
    assert (out.budget, out.bound) == (4096, "per_image_max")


def test_the_record_round_trips():
    record = Record()
    _search(2.0, record, SyntheticRuns(out_of_memory=frozenset({2048})))
    assert Record.from_json(record.to_json()) == record
