"""vitserve/processes/guard.py and zygote.py in fresh processes: the guard ends a forkserver whose
service is gone and leaves any other process alone; ranks fork from the forkserver once it started
(tests/unit/test_processes.py holds what it preloads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.cli import ROOT


def test_the_guard_exits_a_forkserver_whose_service_is_already_gone():
    # The guard reads the service's pid from the environment; a pid that is not the parent means the service
    # died before the guard could ask for PDEATHSIG, so it must leave at once (exit 0) instead of importing on.
    code = "import vitserve.processes.guard; print('still here')"
    env = {"VITSERVE_FORKSERVER_PARENT": "1", "PATH": ""}
    gone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0
    assert "still here" not in gone.stdout
    env["VITSERVE_FORKSERVER_PARENT"] = "0"  # unset: nothing to compare, carries on
    here = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "still here" in here.stdout, here.stderr


def test_outside_the_forkserver_the_guard_leaves_the_process_alone():
    # zygote.py and liveness.py import their constants from the guard: in the service (no SERVICE_PID_ENV)
    # that import must not ask Linux to kill the service with its parent.
    code = (
        "import ctypes, os; import vitserve.processes.guard; sig = ctypes.c_int(-1); "
        "ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(sig), 0, 0, 0); print('pdeathsig', sig.value)"
    )  # 2: PR_GET_PDEATHSIG
    env = {"PATH": ""}
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "pdeathsig 0" in alone.stdout, alone.stderr
    env["VITSERVE_FORKSERVER_PARENT"] = str(os.getpid())  # the forkserver: its parent is this process
    guarded = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert f"pdeathsig {int(signal.SIGKILL)}" in guarded.stdout, guarded.stderr


def test_without_start_ranks_are_spawned_and_after_it_forked_from_the_forkserver(tmp_path):
    # A fresh interpreter: this session's tests/conftest.py may have started the forkserver here already.
    code = (
        "from vitserve.checkpoint import Checkpoint\n"
        "from vitserve import processes\n"
        "from vitserve.processes import zygote\n"
        "print(processes.context().get_start_method())\n"
        "zygote.start(Checkpoint.demo())\n"
        "print(processes.context().get_start_method())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["spawn", "forkserver"], out.stderr
