"""Settings that can never serve: the real `vitserve` CLI exits 2 within 15 s with one line on stderr that
names the flag and a value that works, no traceback, and spawns no rank."""

from __future__ import annotations

import json
import time

import pytest

from tests.checkpoints import make_checkpoint
from tests.cli import Cli

pytestmark = pytest.mark.timeout(120)
LIMIT_S = 15.0


def refuse(tmp_path, *args: str) -> str:
    """Run the CLI; assert the refusal contract; return its one stderr line."""
    start = time.monotonic()
    r = Cli.run(["--port", "0", "--device", "cpu", *args], tmp_path, timeout_s=60)
    seconds = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert seconds < LIMIT_S, f"{seconds:.1f} s"
    assert not (tmp_path / "rt").exists(), "a rank started (it publishes into the runtime dir)"
    return lines[0]


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    return make_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen25"))


def test_budget_below_the_smallest_image(tmp_path):
    line = refuse(tmp_path, "--model", "demo", "--visual_batch_max_tokens", "3")
    assert "--visual_batch_max_tokens 3 is below the smallest Qwen2.5-VL image" in line
    assert "use --visual_batch_max_tokens 4 or more" in line


def test_video_decoders_out_of_range(tmp_path):
    line = refuse(tmp_path, "--video_decoders", "-2")
    assert line.endswith("--video_decoders must be 0..64 (0: no videos), got -2"), line


def test_tp_that_does_not_divide_the_demo(tmp_path):
    line = refuse(tmp_path, "--model", "demo", "--tp", "3")
    assert line.endswith(
        "--tp 3 does not divide the Qwen2.5-VL vision attention heads (8); use --tp 1, 2, 4 or 8"
    )


def test_tp_that_does_not_divide_a_real_checkpoint(tmp_path, qwen25):
    line = refuse(tmp_path, "--model", str(qwen25), "--tp", "8")  # 4 heads, width 32, MLP 64
    assert line.endswith(
        "--tp 8 does not divide the Qwen2.5-VL vision attention heads (4); use --tp 1, 2 or 4"
    )


def test_family_mismatch(tmp_path, qwen25):
    line = refuse(tmp_path, "--model", str(qwen25), "--model_family", "qwen3_vl")
    assert "--model_family qwen3_vl does not match the checkpoint" in line
    assert "use --model_family qwen2_5_vl" in line


def test_checkpoint_without_weights(tmp_path, qwen25):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (bare / name).write_text((qwen25 / name).read_text())
    line = refuse(tmp_path, "--model", str(bare))
    assert f"--model '{bare}' has no weights" in line


def test_checkpoint_without_a_vision_config(tmp_path, qwen25):
    text_only = tmp_path / "text"
    text_only.mkdir()
    top = json.loads((qwen25 / "config.json").read_text())
    del top["vision_config"]
    (text_only / "config.json").write_text(json.dumps(top))
    (text_only / "model.safetensors").write_bytes((qwen25 / "model.safetensors").read_bytes())
    line = refuse(tmp_path, "--model", str(text_only))
    assert "config.json has no vision_config" in line


def test_ipc_endpoint_whose_directory_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("")
    line = refuse(tmp_path, "--model", "demo", "--llm_endpoint", f"ipc://{tmp_path}/file/llm.sock")
    assert "--llm_endpoint" in line
    assert "cannot create its directory" in line


def test_internvl_chat_checkpoint(tmp_path):
    """The remote-code InternVL layout is refused by the one family check (vitserve/families.py)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "internvl_chat"}))
    line = refuse(tmp_path, "--model", str(ckpt))
    assert line.startswith("vitserve: start-up failed: --model: model_type 'internvl_chat'")
