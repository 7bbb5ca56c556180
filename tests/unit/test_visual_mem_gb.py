"""--visual_mem_gb's flags and records (vitserve/flags/encoder_budget.py, vitserve/worker/reservation/sizing.py, record.py):
who sets the budget, what is refused, the diagnostic's knobs, and the stored budget's round trip. The search
itself runs in real ranks: tests/integration/test_visual_mem_gb.py."""

from __future__ import annotations

import pytest

from vitserve.errors import ConfigError
from vitserve.flags import build_config
from vitserve.worker.reservation.record import Method, Reservation
from vitserve.worker.reservation.sizing import Knobs, Measured, diagnostic

KNOBS = Knobs(
    target_gb=2.0,
    tp=2,
    visual_infer_batch_size=64,
    max_video_tokens=16384,
    dtype="bfloat16",
    weights_bytes=650 << 20,
    min_image_tokens=4,
)


def test_the_target_alone_leaves_the_budget_to_the_ranks():
    cfg = build_config(["--visual_mem_gb", "12"], {})
    assert (cfg.visual_mem_gb, cfg.budget_source, cfg.visual_batch_max_tokens) == (12.0, "visual_mem_gb", 0)
    env = build_config([], {"VITSERVE_VISUAL_MEM_GB": "1.5"})
    assert (env.visual_mem_gb, env.budget_source) == (1.5, "visual_mem_gb")


def test_with_a_budget_too_the_budget_is_the_flags():
    cfg = build_config(["--visual_mem_gb", "12", "--visual_batch_max_tokens", "4096"], {})
    assert (cfg.budget_source, cfg.visual_batch_max_tokens) == ("flag", 4096)
    assert build_config([], {}).budget_source == "flag"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--visual_mem_gb", "0"], "--visual_mem_gb must be > 0"),
        (["--visual_mem_gb", "-1"], "--visual_mem_gb must be > 0"),
        (["--visual_mem_gb", "4", "--visual_reserved_mem_gb", "2"], "set one of them"),
    ],
)
def test_targets_that_cannot_work_are_refused(argv, says):
    with pytest.raises(ConfigError, match=says):
        build_config(argv, {})


def test_the_diagnostic_is_one_line_naming_every_knob():
    runs = [Measured(64, 3.1 * 2**30, 1.0), Measured(4, 2.5 * 2**30, 0.5)]
    line = diagnostic(KNOBS, runs, "no budget fits it")
    assert "\n" not in line
    for knob in (
        "--visual_mem_gb 2 per rank",
        "4 tokens: 2.500 GiB",
        "64 tokens: 3.100 GiB",
        "0.635 GiB of weights",
        "--tp 2",
        "--visual_infer_batch_size 64",
        "--max_video_tokens 16384",
        "--dtype bfloat16",
        "smallest image 4 tokens",
        "raise --visual_mem_gb above 2.500 GiB",
    ):
        assert knob in line, knob


def test_the_diagnostic_names_a_budget_that_fitted():
    runs = [Measured(512, 1.5 * 2**30, 1.0), Measured(1024, 2.2 * 2**30, 2.0)]
    assert "use --visual_batch_max_tokens 512 or less" in diagnostic(KNOBS, runs, "no budget fits it")


def test_the_stored_reservation_keeps_the_chosen_budget():
    res = Reservation(123, Method.FULL, tokens=900, images=1, detail="sized", budget_tokens=900)
    assert Reservation.from_stored(res.stored()).budget_tokens == 900
    old = {k: v for k, v in res.stored().items() if k != "budget_tokens"}  # an entry stored before it
    assert Reservation.from_stored(old).budget_tokens == 0


def test_after_the_shrinks_every_probe_within_the_target_is_tried_largest_first():
    """A CPU heap reads more after larger runs than the same budget read as a probe: when the target and its
    three 5% shrinks fail, the probes' budgets within the target follow, largest first, until one passes."""
    from vitserve.model import load_encoder
    from vitserve.worker.reservation import StressShape, sizing

    encoder = load_encoder("demo")
    shape = StressShape(0, 4, max_image_tokens=16384, min_image_tokens=4)
    knobs = Knobs(0.1, 1, 4, 16384, "float32", 0, min_image_tokens=4)
    probes = [Measured(b, gib * 2**30, 0.1) for b, gib in ((64, 0.01), (128, 0.02), (256, 0.04), (512, 0.07))]
    probes.append(Measured(1024, 0.2 * 2**30, 0.1))  # over the target: the bracket is 512 .. 1,024
    tried: list[Measured] = []
    budgets = []
    for budget in sizing._candidates(encoder, shape, knobs, probes, tried):
        budgets.append(budget)
        tried.append(Measured(budget, 1.0 * 2**30 if budget > 128 else 0.05 * 2**30, 0.1))  # all over but 128
        if tried[-1].bytes <= knobs.target_bytes:
            break
    target, *shrinks = budgets[:4]
    assert 512 < target < 1024
    assert all(0.93 <= b / a <= 0.95 for a, b in zip(budgets[:3], shrinks, strict=True)), budgets  # a grid's
    assert budgets[4:] == [512, 256, 128]  # then the probes within the target, largest first
