"""The real `vitserve` CLI as a subprocess, for the tests that need the whole program: `CliServer(args, tmp)`.

It runs `python -m vitserve.cli ARGS` from the repository root with a clean environment (no VITSERVE_*
variable of the caller's, a private runtime directory, one OpenMP thread per rank), collects its output,
and learns the port from the banner's "serving on http://127.0.0.1:PORT" line (start it with --port 0).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def cli_env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(VITSERVE_RUNTIME_DIR=str(Path(tmp_path) / "rt"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class CliServer:
    """`python -m vitserve.cli ...` with its output collected; `url` once the banner names the port."""

    def __init__(self, args: list[str], tmp_path, **env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vitserve.cli", *args],
            cwd=ROOT,
            env=cli_env(tmp_path, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_started(self, limit_s: float = 240) -> None:
        end = time.monotonic() + limit_s
        while self.port is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError("vitserve did not start:\n" + "".join(self.lines[-40:]))
            time.sleep(0.1)

    def wait_ready(self, limit_s: float = 240) -> None:
        """The banner printed and /ready 200."""
        end = time.monotonic() + limit_s
        self.wait_started(limit_s)
        while httpx.get(self.url + "/ready", timeout=5, trust_env=False).status_code != 200:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError("vitserve did not get ready:\n" + "".join(self.lines[-40:]))
            time.sleep(0.2)

    def terminate(self, limit_s: float = 60) -> int:
        """SIGTERM (a clean drain exits 0); killed if it outlives `limit_s`. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError("vitserve did not stop on SIGTERM:\n" + "".join(self.lines[-40:])) from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    @property
    def text(self) -> str:
        return "".join(self.lines)
