"""--visual_mem_gb through the `vitserve` CLI (docs/engine.md, "A budget from a memory target"): the budget
the ranks choose is the processor's clamp, the queue's and /v1/info's, as if --visual_batch_max_tokens had
given it (the CLI's service run in this process); a target no budget fits (the CLI process), or one a given
budget does not fit (its service in this process), exits 2 with one line that names every knob; settings that
contradict it are refused before any rank starts."""

from __future__ import annotations

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.cli import Cli
from tests.e2e.live import cli_exit_in_process, cli_in_process, noise_png

pytestmark = pytest.mark.timeout(300)
ARGS = ["--port", "0", "--device", "cpu", "--visual_infer_batch_size", "4", "--dist_timeout_s", "120"]
KNOBS = ("--tp 1", "--visual_infer_batch_size 4", "--max_video_tokens 16384", "--dtype float32", "of weights")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2")))


def _failure(code: int, stderr: str) -> str:
    """The one diagnostic line of a start-up that exits 2."""
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("vitserve: start-up failed:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_the_chosen_budget_is_served_as_if_the_flag_gave_it(tmp_path, qwen2, capsys):
    """The CLI's service for these flags, run in this process (tests/e2e/live.py cli_in_process): the choice
    and its adoption are the service's; the CLI process's own start and exits are the tests below."""
    with cli_in_process(["--model", qwen2, *ARGS, "--visual_mem_gb", "0.2"], tmp_path) as srv:
        info = httpx.get(srv.url + "/v1/info", timeout=10).json()
        budget = info["budget_tokens"]
        assert info["budget_source"] == "visual_mem_gb"
        assert info["visual_mem_gb"] == 0.2
        assert budget >= 4
        assert info["processor_clamp"]["max_tokens"] == budget  # the image processor clamps to it
        assert info["limits"]["max_queue_tokens"] == 4 * budget  # the queue's default follows it
        banner = capsys.readouterr().err
        assert f"budget_tokens={budget} tokens per batch and per image, budget_source=visual_mem_gb" in banner
        big = httpx.post(
            srv.url + "/encode", files=[("images", ("x.png", noise_png(1024, 1024)))], timeout=120
        )
        assert big.status_code == 200, big.text
        assert big.json()["images"][0]["num_tokens"] <= budget


def test_a_target_below_the_smallest_image_exits_2_naming_every_knob(tmp_path, qwen2):
    r = Cli.run(["--model", qwen2, *ARGS, "--visual_mem_gb", "0.000001"], tmp_path, timeout_s=240)
    line = _failure(r.returncode, r.stderr)
    assert "--visual_mem_gb 1e-06 per rank: no budget fits it" in line
    assert "the family's smallest image 4 tokens" in line
    assert "raise --visual_mem_gb above" in line
    for knob in KNOBS:
        assert knob in line, knob


def test_a_given_budget_over_the_target_exits_2(tmp_path, qwen2, capfd):
    """The service's decision, run in this process (the CLI process's own exit 2 is the test above)."""
    args = ["--model", qwen2, *ARGS, "--visual_mem_gb", "0.000001", "--visual_batch_max_tokens", "64"]
    code = cli_exit_in_process(args, tmp_path)
    line = _failure(code, capfd.readouterr().err)
    assert "--visual_batch_max_tokens 64 does not fit it" in line
    for knob in KNOBS:
        assert knob in line, knob


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--visual_mem_gb", "0"], "--visual_mem_gb must be > 0, got 0.0"),
        (["--visual_mem_gb", "4", "--visual_reserved_mem_gb", "2"], "set one of them"),
    ],
)
def test_settings_that_contradict_it_are_refused_before_any_rank(tmp_path, args, says):
    r = Cli.run(["--port", "0", "--device", "cpu", *args], tmp_path, timeout_s=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().endswith(says), r.stderr
    assert not (tmp_path / "rt").exists()
