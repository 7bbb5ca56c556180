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
    assert Reservation.from_stored(old).sizing is None


def test_the_stored_reservation_keeps_why():
    why = {
        "visual_mem_gb": 4.0,
        "predicted_bytes": 1,
        "measured_bytes": 1,
        "bound": "visual_mem_gb",
        "probes": [64],
    }
    res = Reservation(123, Method.FULL, tokens=900, images=1, detail="sized", budget_tokens=900, sizing=why)
    assert Reservation.from_stored(res.stored()).sizing == why


def test_the_model_record_round_trips_and_a_changed_key_starts_afresh(tmp_path, caplog):
    from vitserve.worker.reservation import stored
    from vitserve.worker.reservation.budget_model import Decision, Point, Record

    record = Record(
        [Point(64, 64, 4096, 1.5e6), Point(128, 128, 16384, float("inf"))], [Decision(2.0, 64, 1)]
    )
    path = stored.model_path(tmp_path / "reservation_cache_cpu_0.json")
    assert path.name == "reservation_model_cpu_0.json"
    stored.store_model(path, {"weights": "a"}, record)
    assert stored.load_model(path, {"weights": "a"}) == record
    assert stored.load_model(path, {"weights": "b"}) == Record()
    assert "another setup" in caplog.text
    stored.invalidate(tmp_path / "reservation_cache_cpu_0.json")  # a live peak above the reservation
    assert not path.exists()
