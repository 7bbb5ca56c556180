"""A real vLLM OpenAI server for the tests (docs/vllm.md): `VllmServer(checkpoint)`.

vLLM lives in a venv of its own, made by scripts/vllm-env.sh (`.venv-vllm`; it pins transformers < 5.20,
vitserve needs >= 5.23), as it would run in its own container. `vllm_python()` finds that venv's interpreter
(env VITSERVE_TEST_VLLM_PYTHON wins); without it the tests skip, except in CI (CI=true), where a missing vLLM
fails them: there these tests must run.

The flags are the ones measured to work on a 2-core CPU: float32, a short context, at most 4 sequences,
`--enable-mm-embeds`, `-O0` (no torch.compile pass: 25-45 s to ready instead of 60-85 s), 1 GiB of KV cache,
no OpenMP thread binding. The server runs in its own process group (vLLM starts an engine-core process);
stop() ends the whole group.

Its processes: on a GPU with one device vLLM runs the model's worker inside the engine-core process; on its CPU
platform it starts the worker as a process of its own unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (the API server
still starts the engine core apart: that variable keeps only the worker in it). `worker_in_engine_core=True` is
that one-GPU layout: two processes, ~40 CPU-s and ~37 s to ready on an idle 2-core machine against ~58 CPU-s
and ~53 s for the default three (measured: tests/vllm/servers.py). vitserve's connector is tested in both
(tests/vllm/connector_server.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.ports import unused_port

ROOT = Path(__file__).resolve().parent.parent
# Measured 25-45 s alone on an idle 2-core machine, 81 and 149 s for the first two of three started at once
# (tests/vllm/test_front_door.py), and past 300 s for the third of three beside two xdist workers at load 6-7.
START_TIMEOUT_S = 600


def vllm_venv_python() -> Path:
    """Where the vLLM venv's interpreter is (or would be)."""
    return Path(os.environ.get("VITSERVE_TEST_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def vllm_python() -> Path:
    """The vLLM venv's interpreter; skips (fails in CI) when there is none."""
    python = vllm_venv_python()
    if python.is_file():
        return python
    message = f"no vLLM venv at {python}: run `bash scripts/vllm-env.sh`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (in CI the vLLM tests must run, not skip)")
    pytest.skip(message)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free 127.0.0.1 port, ready when started (or, with
    wait=False, once `wait_ready()` returns: several can start at once)."""

    def __init__(
        self,
        checkpoint: Path,
        log_dir: Path,
        *,
        limit_mm: dict[str, int] | None = None,
        extra_args: tuple[str, ...] = (),
        wait: bool = True,
        extra_env: dict[str, str] | None = None,
        worker_in_engine_core: bool = False,
    ):
        self.checkpoint = Path(checkpoint)
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"vllm-{self.checkpoint.name}-{self.port}.log"
        limit = limit_mm if limit_mm is not None else {"image": 4, "video": 0}
        argv = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.checkpoint),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "4",
            "--enable-mm-embeds",
            "--limit-mm-per-prompt",
            json.dumps(limit),
            "-O0",
            *extra_args,
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        env.pop("PYTHONPATH", None)  # vitserve's tree is not vLLM's
        if worker_in_engine_core:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(extra_env or {})  # tests/vllm/test_connector.py puts vitserve's package alone on the path
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.ready_s: float | None = None
        self.stopped = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> VllmServer:
        """Block until /health answers 200 (once; seconds since the start in `ready_s`); raises once stopped."""
        if self.ready_s is None:
            self.ready_s = self._wait_ready()
        elif self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
        return self

    def _wait_ready(self) -> float:
        deadline = self.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            if self.alive():
                return time.monotonic() - self.started
            time.sleep(0.5)
        if self.proc.poll() is None and self.alive():  # a server started early and waited on late is ready
            return time.monotonic() - self.started
        self.stop()
        raise RuntimeError(f"vLLM was not ready within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        """GET /health is 200 (vLLM answers 503 or nothing once its engine died)."""
        try:
            return httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 20 s. Once: the tests/vllm fixtures stop a server when
        its tests end and again at the module's end, and a second SIGKILL to the group's id could reach another
        group once the pids have wrapped."""
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # the engine core, should it outlive the server
            os.killpg(self.proc.pid, signal.SIGKILL)
