"""bench/gpu_check.sh's CPU dry run: the device run's every part, on tiny towers, so it never rots; and the
run's own logic (timeouts, the bf16 verdict, the time it asks of a device) without one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
pytestmark = pytest.mark.timeout(600)
TOWERS = ("qwen2_5_vl-7b", "qwen3_vl-8b")


def test_gpu_check_dry_run_runs_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []  # written by rename
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in results, results["errors"]
    meta = results["meta"]
    assert meta["peak_flops"] == max(meta["peak_flops_before"], meta["peak_flops_after"])
    assert list(meta["part_seconds"]) == [  # the headline first
        *(f"{t} {part}" for t in TOWERS for part in ("speed", "graphs")), *(f"{t} exact" for t in TOWERS),
        "reserve", "visual_mem_gb", "handoff", "qwen2_5_vl-7b profile",
    ]  # fmt: skip
    for name in TOWERS:
        _check_tower(results["towers"][name], meta["peak_flops"])
    assert results["towers"]["qwen3_vl-8b"]["exact"][0]["outputs"] == 3  # merged + 2 DeepStack levels (tiny)
    assert results["towers"]["qwen2_5_vl-7b"]["profile"]["eager"]["top"]
    assert [row["method"] for row in results["reserve"]["eager"]] == ["full"]
    assert [row["method"] for row in results["visual_mem_gb"]] == ["full", "full"]
    assert results["handoff"]
    assert results["handoff"][0]["ms"]["file"] > 0


def _check_tower(tower, peak):
    exact = tower["exact"]
    judged = [row for row in exact if row["ok"] is not None]
    assert judged
    assert all(row["ok"] for row in judged), exact
    assert all(row["max_rel"] <= 1e-5 for row in exact)  # float32 on the CPU: round-off only
    assert tower["hf_attn_implementation"]
    # the capture fails on the CPU: recorded, and the eager rows stand beside the padded path's
    assert tower["graphs"]["captured"] == 0
    assert tower["graphs"]["error"].startswith("ValueError")
    assert tower["graphs"]["buckets"] == [256]  # 64 merged tokens: 256 patch rows
    rows = [*tower["speed"], tower["latency"]]
    assert [row["workload"] for row in rows] == ["448px 64", "mixed 64", "1080p"]
    for row in rows:
        assert {"hf_packed", "vitserve_eager", "vitserve_padded"} <= set(row["seconds"])
        assert row["tokens"] <= 64
        assert row["vitserve_padded_vs_eager_rel"] <= 1e-5
        assert row["attention"] == {"grouped SDPA": 4}  # 4 blocks, no varlen kernel on the CPU
        assert row["peak_flops"] == peak
        assert row["mfu"]["vitserve_eager"] > 0
    assert "hf_one_at_a_time" in tower["speed"][0]["seconds"]


def test_a_part_past_its_timeout_is_recorded_and_the_run_goes_on(tmp_path):
    from bench import gpu_check

    args = gpu_check._parse(
        ["--device", "cpu", "--small", "--out", str(tmp_path), "--timeouts", "handoff=0.05"]
    )
    run = gpu_check.Run(args)
    gpu_check._timed_part(run, "handoff", "handoff", lambda: time.sleep(30))
    gpu_check._timed_part(run, "profile", "profile", lambda: run.results.__setitem__("after", True))
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["errors"] == {"handoff": "PartTimeout: past its 0.05 s"}
    assert saved["after"] is True


def test_the_bf16_verdict_judges_ours_against_hfs_own_error():
    from bench.gpu_check_parts import K_BF16, bf16_verdict

    assert K_BF16 == 2.0
    assert bf16_verdict(4.0e-3, 4.0e-3)  # as exact as HF's own bf16
    assert bf16_verdict(7.9e-3, 4.0e-3)
    assert not bf16_verdict(8.1e-3, 4.0e-3)
    assert not bf16_verdict(0.3, 4.0e-3)  # a wrong window or offset: whole rows off


def test_the_device_command_in_the_header_fits_the_tool_twice():
    """15 minutes of device time: the machine's start (~3 min) and this run twice (a rerun)."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    header = script.split("set -uo pipefail")[0]
    command = next(line for line in header.splitlines() if "run(command=" in line)
    assert len(command) <= 2000
    assert 'carry=[".whl"]' in command
    limit = int(re.search(r"timeout_s=(\d+)", command).group(1))
    assert 180 + 2 * limit <= 15 * 60
    steps = [int(s) for s in re.findall(r"^timeout (\d+) ", script, re.MULTILINE)]
    assert sum(steps) + 15 <= limit  # pytest and gpu_check.py, and the wheel's install
    parts = dict(kv.split("=") for kv in re.search(r'TIMEOUTS="([^"]+)"', script).group(1).split())
    per_tower = {"speed", "graphs", "exact"}
    total = sum(float(s) * (len(TOWERS) if p in per_tower else 1) for p, s in parts.items())
    assert total + 25 <= steps[-1]  # imports and the two peak readings
