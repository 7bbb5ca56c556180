"""worker/reservation/worst_case.stress_batches: every batch of the start-up stress is one the scheduler can form at the budget
(tokens <= budget, images <= --visual_infer_batch_size), the worst case comes first and last, and the others
fill the budget (docs/design.md invariant 7)."""

from __future__ import annotations

import pytest

from tests.fakes import FakeEncoderFactory
from vitserve.config import Config
from vitserve.families import DISABLED_BUDGET_TOKENS
from vitserve.worker.reservation.worst_case import stress_batches, worst_case_items


def _encoder():
    return FakeEncoderFactory()(Config(visual_reserved_mem_gb=0.0))  # a Qwen-family tower config, no stress


def _shape(items) -> list[tuple[int, ...]]:
    return [tuple(it.grid_thw) for it in items]


@pytest.mark.parametrize(("budget", "max_images"), [(1024, 8), (256, 64), (97, 3), (4, 1), (1, 5)])
def test_every_stress_batch_is_admissible_and_the_worst_case_brackets_them(budget, max_images):
    enc = _encoder()
    batches = list(stress_batches(enc, budget, max_images))
    worst = _shape(worst_case_items(enc, budget, max_images))
    assert _shape(batches[0]) == _shape(batches[-1]) == worst
    for items in batches:
        assert 1 <= len(items) <= max_images
        assert sum(it.num_tokens for it in items) <= budget
        for it in items:
            t, h, w = it.grid_thw
            assert it.pixel_values.shape[0] == t * h * w  # (patches, C*T*P*P) like the processor's output
            assert it.num_tokens == h * w // 4
    if budget in (1024, 256):  # (a prime budget has no near-square worst case: it is the thin one)
        assert len(batches) == 5  # worst, thin, equal, mixed, worst
        shapes = {tuple(_shape(items)) for items in batches}
        assert len(shapes) == 4
        assert all(sum(it.num_tokens for it in items) >= 0.9 * budget for items in batches)


def test_budget_off_stresses_the_documented_default():
    batches = list(stress_batches(_encoder(), 0, 4))
    assert sum(it.num_tokens for it in batches[0]) == DISABLED_BUDGET_TOKENS
    assert all(sum(it.num_tokens for it in items) <= DISABLED_BUDGET_TOKENS for items in batches)
