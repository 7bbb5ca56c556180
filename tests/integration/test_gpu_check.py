"""bench/gpu_check.sh's CPU dry run: the device run's every part, on tiny towers, so it never rots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def test_gpu_check_dry_run_runs_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in results, results["errors"]
    for name in ("qwen2_5_vl-7b", "qwen3_vl-8b"):
        tower = results["towers"][name]
        exact = tower["exact"]
        assert exact
        assert all(row["ok"] for row in exact if row["ok"] is not None), exact
        assert all(row["max_rel"] <= 1e-5 for row in exact)  # float32 on the CPU: round-off only
        assert tower["speed"]
        assert all(row["graphs_vs_eager_rel"] <= 1e-5 for row in tower["speed"])
        assert set(tower["speed"][0]["seconds"]) >= {
            "hf_one_at_a_time",
            "hf_packed",
            "vitserve_eager",
            "vitserve_graphs",
        }
    assert results["towers"]["qwen3_vl-8b"]["exact"][0]["outputs"] == 3  # merged + 2 DeepStack levels (tiny)
    assert results["towers"]["qwen2_5_vl-7b"]["profile"]["eager"]["top"]
    assert [row["method"] for row in results["reserve"]["eager"]] == ["full"]
    assert [row["method"] for row in results["reserve"]["visual_mem_gb"]] == ["full", "full"]
    assert results["handoff"]
    assert results["handoff"][0]["ms"]["file"] > 0


def test_the_device_command_in_the_header_fits_the_tool():
    header = (ROOT / "bench" / "gpu_check.sh").read_text().split("set -uo pipefail")[0]
    command = next(line for line in header.splitlines() if "run(command=" in line)
    assert len(command) <= 2000
    assert 'carry=[".whl"]' in command
