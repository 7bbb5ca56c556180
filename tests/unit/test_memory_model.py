"""The memory model (vitserve/worker/reservation/memory_model.py): the fit and the choice of shapes. Its validation against
full-budget measurements is tests/integration/test_memory_model.py."""

from __future__ import annotations

import pytest

from vitserve.worker.reservation import memory_model as mm
from vitserve.worker.reservation.memory_model import MODEL_FACTOR, Fit, Probe, Shape

# --- the fit ------------------------------------------------------------------------------------------------


def _shape(n: int) -> Shape:
    return Shape.of_units([n])  # one image of n tokens


def test_fit_recovers_a_quadratic():
    points = [(_shape(n), 5 + 3 * n + 0.5 * n * n) for n in (10, 20, 40, 80)]
    got = mm.fit(points)
    assert got.a == pytest.approx(5, abs=1e-6)
    assert (got.b, got.c) == (pytest.approx(3), pytest.approx(0.5))


def test_a_fit_that_bends_down_becomes_the_best_line():
    points = [(_shape(n), y) for n, y in ((64, 35.2), (128, 48.0), (256, 72.0))]  # the demo's probes
    got = mm.fit(points)
    assert got.c == 0
    assert got.b > 0
    assert got.at(_shape(8192)) > 72.0


def test_units_of_one_size_are_fitted_by_a_line():
    # InternVL: every probe is k tiles of 4 tokens, squares = 4 * tokens, so c cannot be told from b
    points = [(Shape.of_units([4] * k), 10 + 2 * 4 * k) for k in (16, 32, 64)]
    got = mm.fit(points)
    assert got.c == 0
    assert got.at(Shape.of_units([4] * 1024)) == pytest.approx(10 + 8 * 1024)


def test_a_falling_line_is_replaced_by_the_largest_value():
    got = mm.fit([(_shape(n), y) for n, y in ((1, 9.0), (2, 5.0), (3, 4.0))])
    assert got == Fit(9.0, 0.0, 0.0)


def test_probe_budgets():
    assert mm.probe_budgets(8192) == [64, 128, 256, 512, 1024, 2048]
    assert mm.probe_budgets(1024) == [64, 128, 256]
    assert len(mm.probe_budgets(512)) < mm.MIN_PROBES  # too small to extrapolate: the full stress runs
    assert mm.probe_budgets(2**20)[0] == 2**20 // 128


def _fake_measure(seconds_per_token: float):
    def measure(budget: int) -> Probe:
        return Probe(budget, _shape(budget), 1000 + 10 * budget, seconds_per_token * budget)

    return measure


def test_a_fast_full_stress_is_run_instead_of_extrapolated():
    assert mm.estimate(8192, _shape(8192), _fake_measure(1e-6)) is None


def test_a_slow_full_stress_is_extrapolated_from_the_probes_up_to_the_target_time():
    est = mm.estimate(8192, _shape(8192), _fake_measure(0.005))  # 64 tokens: 0.32 s; 256: 1.28 s
    assert est is not None
    assert [p.budget for p in est.probes] == [64, 128, 256]
    assert est.predicted_bytes == pytest.approx(1000 + 10 * 8192, abs=1)
    assert est.reserved_bytes == int(est.predicted_bytes * MODEL_FACTOR)
    assert est.predicted_seconds == pytest.approx(0.005 * 8192)


def _timed(seconds: dict[int, float], measured: list[int]):
    def measure(budget: int) -> Probe:
        measured.append(budget)
        return Probe(budget, _shape(budget), 1000 + 10 * budget, seconds[budget])

    return measure


def test_probes_too_small_to_time_do_not_call_a_slow_full_stress_fast():
    """Measured on a tiny Qwen2-VL at 8,192 tokens on a CPU (the full forward: 11-15 s, five of them). The first
    three probes fit ~1.4 s per forward, under FULL_STRESS_MAX_S; only the larger ones show the quadratic cost."""
    seconds = {64: 0.0255, 128: 0.0285, 256: 0.0564, 512: 0.1319, 1024: 0.4323, 2048: 1.675}
    first_three = [Probe(b, _shape(b), 0, seconds[b]) for b in (64, 128, 256)]
    early = mm.Estimate(
        tuple(first_three), Fit(0, 0, 0), mm.fit([(p.shape, p.seconds) for p in first_three]), _shape(8192)
    )
    assert early.predicted_seconds <= mm.FULL_STRESS_MAX_S  # what decided "run the full stress" before
    assert early.upper_bound_seconds > mm.FULL_STRESS_MAX_S  # 0.056 s at 1/32 of the tokens: up to 58 s
    measured: list[int] = []
    est = mm.estimate(8192, _shape(8192), _timed(seconds, measured))
    assert est is not None  # extrapolated
    assert measured == [64, 128, 256, 512, 1024, 2048]
    assert est.predicted_seconds > mm.FULL_STRESS_MAX_S


def test_fast_probes_run_the_full_stress_once_their_bound_says_so():
    """A GPU's probes: a fixed launch cost, then linear and quadratic terms (here 0.71 s at 16,384 tokens).
    The tiny ones cannot vouch for the full forward; the third-largest can, and the full stress runs."""

    def t(n: int) -> float:
        return 0.008 + 2e-6 * n + 2.5e-9 * n * n

    seconds = {b: t(b) for b in mm.probe_budgets(16384)}
    measured: list[int] = []
    assert mm.estimate(16384, _shape(16384), _timed(seconds, measured)) is None
    assert measured == [128, 256, 512, 1024, 2048]  # 2048: 0.0225 s, at most 1.44 s at 16,384


def test_the_last_probe_decides_by_the_prediction_when_the_bound_is_loose():
    """Probes up to budget/4 whose quadratic bound stays above the limit: the fit at the last one decides, as
    the prediction always did (a full forward of ~1 s runs the full stress)."""
    seconds = {b: 0.2 * b / 2048 for b in mm.probe_budgets(8192)}  # linear: 0.8 s per full forward
    # the bound at each probe: 0.2 s at 2048 tokens times (8192 / 2048)^2 = 3.2 s, above the limit
    measured: list[int] = []
    assert mm.estimate(8192, _shape(8192), _timed(seconds, measured)) is None
    assert measured == mm.probe_budgets(8192)


def test_budget_zero_predicts_max_images_of_the_largest_image():
    # per-image quadratic term: 64 images of 1024 tokens cost 64x one image, not (64 * 1024)^2
    probes = [Probe(b, _shape(b), 100 + 2 * b + b * b, 0.0) for b in (64, 128, 256)]
    full = Shape.of_units([1024] * 64)
    est = mm.Estimate(tuple(probes), mm.fit([(p.shape, p.bytes) for p in probes]), Fit(0, 0, 0), full)
    assert est.predicted_bytes == pytest.approx(100 + 64 * (2 * 1024 + 1024**2), rel=1e-6)
