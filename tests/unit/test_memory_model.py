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


def test_the_full_stress_is_judged_by_all_of_its_forwards():
    """The full stress runs stress_batch_count forwards of about the full shape, not one."""
    one_second = _fake_measure(1 / 8192)  # one full-budget forward: 1 s
    assert mm.estimate(8192, _shape(8192), one_second, full_forwards=1) is None
    est = mm.estimate(8192, _shape(8192), one_second, full_forwards=5)
    assert est is not None
    assert est.stress_seconds == pytest.approx(5.0)


def test_tiny_noisy_probes_never_predict_less_than_the_largest_probe_per_token():
    """Probes of a few milliseconds are mostly noise: times that fall as the shape grows fit a flat line at
    their largest value (0.3 s here), which would call an 8,192-token forward fast. The largest probe's time
    per token bounds it from below instead (work per token does not fall as a batch grows)."""
    times = {64: 0.3, 128: 0.2, 256: 0.1, 512: 0.2, 1024: 0.4, 2048: 0.8}

    def measure(budget: int) -> Probe:
        return Probe(budget, _shape(budget), 1000 + 10 * budget, times[budget])

    assert mm.fit([(_shape(b), times[b]) for b in (64, 128, 256)]).at(_shape(8192)) == 0.3
    est = mm.estimate(8192, _shape(8192), measure)
    assert est is not None  # 0.1 s at 256 tokens: at least 3.2 s at 8,192, above FULL_STRESS_MAX_S
    assert [p.budget for p in est.probes] == [64, 128, 256, 512, 1024, 2048]
    assert est.predicted_seconds == pytest.approx(0.8 * 4)


def test_budget_zero_predicts_max_images_of_the_largest_image():
    # per-image quadratic term: 64 images of 1024 tokens cost 64x one image, not (64 * 1024)^2
    probes = [Probe(b, _shape(b), 100 + 2 * b + b * b, 0.0) for b in (64, 128, 256)]
    full = Shape.of_units([1024] * 64)
    est = mm.Estimate(tuple(probes), mm.fit([(p.shape, p.bytes) for p in probes]), Fit(0, 0, 0), full)
    assert est.predicted_bytes == pytest.approx(100 + 64 * (2 * 1024 + 1024**2), rel=1e-6)
