"""The one launcher of the real `vitserve` CLI for the tests and the benchmarks: `Cli(args, tmp_path)`.

    srv = Cli(["--model", "demo", "--port", "0"], tmp_path)   # python -m vitserve.cli ARGS
    srv.wait_ready()                                          # the banner named the port, /ready 200
    assert srv.terminate() == 0                               # SIGTERM drains and exits 0

It runs from the repository root with a clean environment (`cli_env`: no VITSERVE_* variable of the
caller's, a private runtime directory, one OpenMP thread per rank), collects its output lines with their
arrival times, and learns the port from the banner's "serving on http://127.0.0.1:PORT" line (start it
with --port 0). `session=True` gives it a process group of its own (signal_all reaches its ranks and
forkserver too, as when a machine dies); `command` runs something else that execs the CLI (a shell, a
torchrun or `ip netns exec` prefix); `log` copies the output to a file (the benchmarks keep it).
`Cli.run(args, tmp_path)` runs one that exits by itself (a refused setting, --help) to completion.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "vitserve.cli"]
BANNER_PORT = re.compile(r"serving on http://127\.0\.0\.1:(\d+)")


def cli_env(tmp_path, **extra: str) -> dict[str, str]:
    """The caller's environment less VITSERVE_*, with a runtime dir under `tmp_path`, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(VITSERVE_RUNTIME_DIR=str(Path(tmp_path) / "rt"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class Cli:
    """`python -m vitserve.cli ARGS` as a subprocess, its output collected; `url` once the banner names the
    port. `env`: the whole environment (default `cli_env(tmp_path)`); `extra_env` goes on top of it."""

    def __init__(
        self,
        args: Sequence[str],
        tmp_path=None,
        *,
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        cwd: Path = ROOT,
        session: bool = False,
        log: Path | None = None,
    ):
        environ = dict(cli_env(tmp_path) if env is None else env) | dict(extra_env or {})
        self.proc = subprocess.Popen(
            [*CLI, *args] if command is None else [*command, *args],
            cwd=cwd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=session,
        )
        self.session = session
        self.timed_lines: list[tuple[float, str]] = []
        self.port: int | None = None
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def run(
        cls, args: Sequence[str], tmp_path, *, timeout_s: float = 120, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run the CLI to its exit (stdout and stderr apart), e.g. a setting refused with exit 2."""
        return subprocess.run(
            [*CLI, *args], cwd=ROOT, env=cli_env(tmp_path, **env), capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self._log or os.devnull, "w") as log:
            for line in self.proc.stdout:
                self.timed_lines.append((time.monotonic(), line))
                log.write(line)
                if self.port is None and (m := BANNER_PORT.search(line)):
                    self.port = int(m.group(1))

    # ------------------------------------------------------------------------------------ output

    @property
    def lines(self) -> list[str]:
        return [line for _, line in self.timed_lines]

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------ waiting

    def wait_for(self, pattern: str, limit_s: float = 240) -> float:
        """The arrival time of the first output line matching `pattern`."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            for at, line in list(self.timed_lines):
                if re.search(pattern, line):
                    return at
            if self.proc.poll() is not None:
                self._reader.join(5)  # the reader may still hold the last lines
                if not any(re.search(pattern, line) for line in self.lines):
                    break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.text[-4000:]}")

    def wait_started(self, limit_s: float = 240) -> None:
        """The banner named the port."""
        end = time.monotonic() + limit_s
        while self.port is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError("vitserve did not start:\n" + self.tail())
            time.sleep(0.1)

    def wait_ready(self, limit_s: float = 240, route: str = "/ready") -> float:
        """Seconds from now until the banner named the port and `route` answered 200."""
        start = time.monotonic()
        end = start + limit_s
        self.wait_started(limit_s)
        while True:
            try:
                if httpx.get(self.url + route, timeout=5, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError("vitserve did not get ready:\n" + self.tail())
            time.sleep(0.2)

    # ------------------------------------------------------------------------------------ stopping

    def wait_exit(self, limit_s: float = 60) -> str:
        """Wait for the process to exit (subprocess.TimeoutExpired if it does not); all of its output."""
        self.proc.wait(limit_s)
        self._reader.join(limit_s)
        return self.text

    def signal_all(self, sig: int) -> None:
        """Signal every process of a `session=True` CLI (its ranks and forkserver too)."""
        assert self.session, "signal_all needs Cli(..., session=True)"
        os.killpg(self.proc.pid, sig)

    def terminate(self, limit_s: float = 60) -> int:
        """SIGTERM (a clean drain exits 0); killed if it outlives `limit_s`. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError("vitserve did not stop on SIGTERM:\n" + self.tail()) from None

    def stop(self) -> None:
        """SIGKILL now (its whole process group with session=True) and reap it."""
        if self.proc.poll() is None:
            if self.session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> Cli:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
