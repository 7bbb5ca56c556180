"""Stopping a test run leaves no process behind (tests/parallel.py `end_with_the_run`): a real pytest, serial
and with a real xdist worker, is told to stop while its test holds two children, one in a session of its own
(a server, as tests/vllm_server.py starts vLLM) and one in pytest's group; the test never cleans up itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.parallel import ROOT

CONFTEST = """
from tests import parallel

def pytest_configure(config):
    parallel.end_with_the_run(config)
"""
TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_holds_two_children():
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    children = [subprocess.Popen(sleep, start_new_session=True), subprocess.Popen(sleep)]
    pids = [os.getpid()] + [child.pid for child in children]
    Path(os.environ["PIDS_FILE"]).write_text(" ".join(map(str, pids)))
    time.sleep(600)
"""
GONE_WITHIN_S = 60  # a liveness deadline, not a speed bar: the children get SIGTERM at once


def _alive(pid: int) -> bool:
    """Running, not a zombie: a killed child whose parent died may wait for a reaper that never comes."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(path: Path, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_text():
            return [int(pid) for pid in path.read_text().split()]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the test never started its children:\n{proc.communicate()[0]}")


@pytest.mark.parametrize(
    ("workers", "how"),
    [
        (["-n", "1"], "sigterm"),  # to the controller alone: its worker follows it (PR_SET_PDEATHSIG)
        (["-n", "1"], "ctrl-c"),  # SIGINT to pytest's whole group, as a terminal sends it
        ([], "sigterm"),  # serial
    ],
)
def test_stopping_the_run_ends_every_process_it_started(tmp_path, workers, how):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hold.py").write_text(TEST)
    pids_file = tmp_path / "pids"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PIDS_FILE": str(pids_file),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own worker, should it run under one
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "xdist.plugin",
        "-p",
        "no:cacheprovider",
        *workers,
        "test_hold.py",
    ]
    pytest_proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    runner, *children = _wait_for(pids_file, pytest_proc)
    assert (runner != pytest_proc.pid) == bool(workers)  # the test ran in a worker, or in pytest itself
    if how == "ctrl-c":
        os.killpg(pytest_proc.pid, signal.SIGINT)
    else:
        pytest_proc.send_signal(signal.SIGTERM)
    pytest_proc.communicate(timeout=GONE_WITHIN_S)
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(map(_alive, [runner, *children])):
        time.sleep(0.1)
    left = [pid for pid in [runner, *children] if _alive(pid)]
    for pid in left:  # not to leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after {GONE_WITHIN_S} s: {left} (runner {runner}, children {children})"
