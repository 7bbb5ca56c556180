"""docs/design.md invariant 16: SIGKILL the process that owns the engine; every worker exits on its own within seconds."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.engine_helpers import assert_gone, kill_quietly, pid_running

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.solo  # gone within 5 s of the parent's death: no neighbour test slows their exit
def test_workers_exit_when_the_parent_is_sigkilled(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.engine_child", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = parent.stdout.readline()  # the engine is ready once it prints its workers' pids
        pids = json.loads(line)
        assert len(pids) == 2
        assert all(pid_running(p) for p in pids)
        parent.send_signal(signal.SIGKILL)  # no atexit, no shutdown(): the workers are on their own
        parent.wait(timeout=10)
        assert_gone(pids, within_s=5.0)
    finally:
        parent.kill()
        parent.wait()
        for pid in locals().get("pids", []):
            kill_quietly(pid, signal.SIGKILL)
