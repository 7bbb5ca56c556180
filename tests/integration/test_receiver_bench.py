"""bench/transfer.py still runs end to end (tiny sizes; spawns sender processes, so marked slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transfer.py"


@pytest.mark.slow
def test_transfer_bench_runs_and_reports_every_row(tmp_path):
    # 0.5-1 MB messages: the bench rounds GB/s to 2 decimals, and 8 KB ones round to 0.00 on a loaded machine
    argv = [
        "--out",
        str(tmp_path),
        "--tokens",
        "1024",
        "--dim",
        "256",
        "--messages",
        "2",
        "--trials",
        "1",
        "--reps",
        "2",
        "--naive",
        "--json",
    ]
    out = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=240, check=True
    )
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["dtype"], r["path"]) for r in rows] == [
        (d, p) for d in ("float32", "bfloat16") for p in ("ipc", "tcp", "ipc copy=True")
    ]
    assert all(r["zmq_GBps"] > 0 and r["clone_GBps"] > 0 for r in rows)
    # the run record (bench/record.py) holds the same rows, with the commit and the load they ran at
    (line,) = (tmp_path / "transfer.jsonl").read_text().splitlines()
    run = json.loads(line)
    assert run["results"] == rows
    assert run["commit"]
    assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
