"""The real `vitserve` CLI stopped by a signal during start-up: every process of the service ends within 5 s.

Docker and Kubernetes send SIGTERM, then SIGKILL after 10-30 s; a service that ignores SIGTERM until its
start-up ends is killed hard and may leave ranks behind. SIGINT goes to the whole process group, as Ctrl-C
in a terminal sends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cli import Cli
from tests.e2e.netcheck import children_of
from tests.e2e.test_cli_process import BASE_ARGS, FAST_START
from tests.ports import unused_port

pytestmark = pytest.mark.timeout(300)
STOP_LIMIT_S = 5.0


def state_of(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a reaped-later zombie holds no memory and runs nothing)."""
    return state_of(pid) not in (None, "Z", "X")


def rank_pids(pid: int) -> list[int]:
    """Descendants that are encoder ranks: forked from the ranks' forkserver (vitserve/processes/zygote.py; the
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


def start_cli(tmp_path: Path, *args: str) -> Cli:
    # TMPDIR: where the engine makes its private ipc dir, whose socket paths must stay under AF_UNIX's 108
    # bytes: a short directory (tmp_path under an xdist worker is too long), seen as tmp_path / "tmp" (an
    # empty directory of the system's temp dir is left). Its own process group, so SIGINT can go to all of
    # it like Ctrl-C
    short = Path(tempfile.mkdtemp(prefix="lc-"))
    (tmp_path / "tmp").symlink_to(short)
    return Cli(args, tmp_path, extra_env={"TMPDIR": str(short)}, session=True)


def wait_for_ranks(cli: Cli, count: int, limit_s: float = 180) -> None:
    end = time.monotonic() + limit_s
    while len(rank_pids(cli.proc.pid)) < count:
        if cli.proc.poll() is not None or time.monotonic() > end:
            cli.stop()
            raise AssertionError("the ranks were never spawned:\n" + cli.text[-3000:])
        time.sleep(0.1)


def stop_and_watch(cli: Cli, sig: signal.Signals, *, group: bool) -> list[int]:
    """Send `sig`, then return the pids of the service still alive STOP_LIMIT_S later."""
    proc = cli.proc
    everyone = [proc.pid, *children_of(proc.pid)]
    if group:
        cli.signal_all(sig)
    else:
        proc.send_signal(sig)
    end = time.monotonic() + STOP_LIMIT_S
    while time.monotonic() < end and any(alive(p) for p in everyone):
        proc.poll()  # reap the parent as soon as it exits (it is our child)
        time.sleep(0.05)
    proc.poll()
    return [p for p in everyone if alive(p)]


def described(cli: Cli, sig: signal.Signals, pids: list[int]) -> str:
    """Why a stop failed: each process left, its state and command line, then the service's output."""
    rows = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            cmdline = ""
        rows.append(f"  {pid} {state_of(pid) or 'gone'} {cmdline}")
    return "\n".join([f"still alive {STOP_LIMIT_S} s after {sig.name} (the service is {cli.proc.pid}):", *rows,
                      "its output:", cli.tail()])  # fmt: skip


def kill_everything(cli: Cli, pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cli.proc.wait(30)


@pytest.mark.solo  # STOP_LIMIT_S is a contract (Docker's stop timeout): no neighbour test slows the exit
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_startup_ends_every_process_within_5s(tmp_path, sig):
    # The default budget: the ranks' start-up (torch import, weights, the memory measurement) takes far
    # longer than the test waits, so the signal surely lands during start-up.
    cli = start_cli(tmp_path, "--model", "demo", "--tp", "2", "--device", "cpu", "--port", "0")
    wait_for_ranks(cli, 2)
    time.sleep(2)  # the ranks are busy starting up
    left = stop_and_watch(cli, sig, group=sig == signal.SIGINT)
    out = ""
    try:
        assert not left, described(cli, sig, left)
        out = cli.wait_exit(30)
        assert cli.proc.returncode == 128 + sig, out[-3000:]
        assert f"stopped by {sig.name} during start-up" in out
        assert not list((tmp_path / "rt").glob("reserved_mem_*")), "reservation files left behind"
        assert not list((tmp_path / "tmp").glob("vitserve-*")), "the ipc dir was left behind"
    finally:
        kill_everything(cli, left)
    if sig == signal.SIGTERM:  # SIGINT reaches the ranks too; one still importing torch may print a trace
        assert "Traceback" not in out, out[-3000:]


@pytest.mark.solo  # STOP_LIMIT_S, as above
@pytest.mark.parametrize("delay_s", [0.5, 1.0, 1.5, 2.0, 3.0])
def test_sigterm_before_any_rank_exits_at_once(tmp_path, delay_s):
    # Importing torch and transformers, reading the checkpoint: the handler is installed first thing. A
    # handler that raised into those imports was caught by library code at some moments, and start-up
    # went on (or failed with a traceback); each delay lands in a different import.
    cli = start_cli(tmp_path, "--model", "demo", "--device", "cpu", "--port", "0")
    time.sleep(delay_s)
    left = stop_and_watch(cli, signal.SIGTERM, group=False)
    try:
        assert not left, described(cli, signal.SIGTERM, left)
        out = cli.wait_exit(30)
    finally:
        kill_everything(cli, left)
    assert cli.proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out, out


def test_polling_ready_while_starting_is_quiet_and_kept_out_of_request_metrics(tmp_path):
    port = unused_port()
    srv = Cli([*BASE_ARGS[:2], "--port", str(port), *BASE_ARGS[4:], *FAST_START], tmp_path)
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
