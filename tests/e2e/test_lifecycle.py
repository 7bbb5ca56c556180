"""The real `vitserve` CLI stopped by a signal during start-up: every process of the service ends within 5 s.

Docker and Kubernetes send SIGTERM, then SIGKILL after 10-30 s; a service that ignores SIGTERM until its
start-up ends is killed hard and may leave ranks behind. SIGINT goes to the whole process group, as Ctrl-C
in a terminal sends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cli import ROOT, CliServer, cli_env
from tests.e2e.netcheck import children_of
from tests.e2e.test_cli_process import BASE_ARGS

pytestmark = pytest.mark.timeout(300)
STOP_LIMIT_S = 5.0


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a reaped-later zombie holds no memory and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def rank_pids(pid: int) -> list[int]:
    """Descendants that are encoder ranks: forked from the ranks' forkserver (vitserve/worker/zygote.py; the
    forkserver is the service's child, a rank is the forkserver's child with the same command line), or
    started by multiprocessing's spawn."""
    ranks = []
    for child in children_of(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{child}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmdline or (b"multiprocessing.forkserver" in cmdline and parent != pid):
            ranks.append(child)
    return ranks


def start_cli(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = cli_env(tmp_path)
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the engine makes its private ipc dir
    (tmp_path / "tmp").mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "vitserve.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so SIGINT can go to all of it like Ctrl-C
    )


def wait_for_ranks(proc: subprocess.Popen[str], count: int, limit_s: float = 180) -> None:
    end = time.monotonic() + limit_s
    while len(rank_pids(proc.pid)) < count:
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError("the ranks were never spawned:\n" + proc.communicate()[0][-3000:])
        time.sleep(0.1)


def stop_and_watch(proc: subprocess.Popen[str], sig: signal.Signals, *, group: bool) -> list[int]:
    """Send `sig`, then return the pids of the service still alive STOP_LIMIT_S later."""
    everyone = [proc.pid, *children_of(proc.pid)]
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    end = time.monotonic() + STOP_LIMIT_S
    while time.monotonic() < end and any(alive(p) for p in everyone):
        proc.poll()  # reap the parent as soon as it exits (it is our child)
        time.sleep(0.05)
    proc.poll()
    return [p for p in everyone if alive(p)]


def kill_everything(proc: subprocess.Popen[str], pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_startup_ends_every_process_within_5s(tmp_path, sig):
    # The default budget: the ranks' start-up (torch import, weights, the memory measurement) takes far
    # longer than the test waits, so the signal surely lands during start-up.
    proc = start_cli(tmp_path, "--model", "demo", "--tp", "2", "--device", "cpu", "--port", "0")
    wait_for_ranks(proc, 2)
    time.sleep(2)  # the ranks are busy starting up
    left = stop_and_watch(proc, sig, group=sig == signal.SIGINT)
    out = ""
    try:
        assert not left, f"still alive {STOP_LIMIT_S} s after {sig.name}: {left}"
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 128 + sig, out[-3000:]
        assert f"stopped by {sig.name} during start-up" in out
        assert not list((tmp_path / "rt").glob("reserved_mem_*")), "reservation files left behind"
        assert not list((tmp_path / "tmp").glob("vitserve-*")), "the ipc dir was left behind"
    finally:
        kill_everything(proc, left)
    if sig == signal.SIGTERM:  # SIGINT reaches the ranks too; one still importing torch may print a trace
        assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("delay_s", [0.5, 1.0, 1.5, 2.0, 3.0])
def test_sigterm_before_any_rank_exits_at_once(tmp_path, delay_s):
    # Importing torch and transformers, reading the checkpoint: the handler is installed first thing. A
    # handler that raised into those imports was caught by library code at some moments, and start-up
    # went on (or failed with a traceback); each delay lands in a different import.
    proc = start_cli(tmp_path, "--model", "demo", "--device", "cpu", "--port", "0")
    time.sleep(delay_s)
    left = stop_and_watch(proc, signal.SIGTERM, group=False)
    try:
        assert not left
        out = proc.communicate(timeout=30)[0]
    finally:
        kill_everything(proc, left)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_polling_ready_while_starting_is_quiet_and_kept_out_of_request_metrics(tmp_path):
    port = _free_port()
    srv = CliServer([*BASE_ARGS[:2], "--port", str(port), *BASE_ARGS[4:]], tmp_path)
    url = f"http://127.0.0.1:{port}"
    codes: list[int] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            end = time.monotonic() + 240
            while not codes or codes[-1] != 200:
                assert srv.proc.poll() is None, srv.text[-3000:]
                assert time.monotonic() < end, "never ready"
                with contextlib.suppress(httpx.TransportError):  # before the socket is bound
                    codes.append(c.get("/ready").status_code)
                time.sleep(0.1)
            metrics = c.get("/metrics").text
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    assert codes.count(503) >= 1, "never polled before ready"
    assert set(codes) == {503, 200}
    assert "vitserve_requests_total{" not in metrics  # only probes were sent
    assert f'vitserve_probes_total{{code="503",path="/ready"}} {float(codes.count(503))}' in metrics
    text = srv.text
    assert "not_ready" not in text  # the 503 answers are logged at DEBUG, below the default INFO
    assert "Traceback" not in text
    warmed = text.index("encoder group 0 passed its warm-up encode")
    assert warmed < text.index("serving on http://")
