"""Start-up benchmark: the real CLI, `vitserve --model demo` at the default budget, cold and then warm.

    python bench/startup.py                    # one cold start (fresh runtime dir), then --warm warm starts
    python bench/startup.py --warm 3 --budget 8192

Cold: a fresh --runtime_dir, so the rank measures its reservation (docs/engine.md, "Start-up"). Warm: the
same runtime dir again, nothing changed, so the stored reservation is used and no stress runs. Each start
is timed from the process launch to the first `/ready` 200 (polled every 0.1 s), then stopped with SIGTERM.
The server's output is kept next to the record; the phase lines it prints ("vitserve [group 0] +4.1 s ...",
seconds since the rank started) are copied into the record, so a slow phase can be found. The record (commit, machine,
load before and after, each start with the load average it ran at) is appended to bench/out/startup.jsonl
(bench/record.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import record  # noqa: E402
from tests.cli import Cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_start(runtime_dir: Path, budget: int, log_path: Path) -> dict:
    """Launch the CLI, wait for /ready 200, stop it; seconds to ready and the phase lines with their times."""
    port = free_port()
    env = {**os.environ, "VITSERVE_RUNTIME_DIR": str(runtime_dir)}
    args = ["--model", "demo", "--port", str(port), "--visual_batch_max_tokens", str(budget)]
    start = time.monotonic()
    server = Cli(args, env=env, log=log_path)
    try:
        ready_s = _wait_ready(f"http://127.0.0.1:{port}/ready", server.proc, start)
    finally:
        with contextlib.suppress(AssertionError):  # killed after 60 s
            server.terminate(60)
        server.wait_exit(60)  # the log file is complete
    text = log_path.read_text()
    phases = [line for line in text.splitlines() if line.startswith("vitserve [group")]
    return {
        "ready_s": round(ready_s, 2),
        "loadavg": list(os.getloadavg()),
        "stress_skipped": any("stress: skipped" in line for line in phases),
        "phases": phases,
        "exit_code": server.proc.returncode,
    }


def _wait_ready(url: str, proc: subprocess.Popen[str], start: float) -> float:
    while time.monotonic() - start < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"vitserve exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"vitserve not ready after {READY_TIMEOUT_S} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=8192, help="--visual_batch_max_tokens (default 8192)")
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    record.unwind_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    run = record.begin("startup", args)
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-rt-") as tmp:
        runtime_dir = Path(tmp)
        starts = []
        for k in range(1 + args.warm):
            kind = "cold" if k == 0 else "warm"
            result = {"kind": kind, **one_start(runtime_dir, args.budget, args.out / f"startup-{k}.log")}
            print(f"{kind}: ready in {result['ready_s']} s (load {result['loadavg'][0]:.2f})", flush=True)
            starts.append(result)
    report = {
        "budget": args.budget,
        "starts": starts,
        "cold_s": starts[0]["ready_s"],
        "warm_s": [s["ready_s"] for s in starts[1:]],
    }
    print(json.dumps({k: report[k] for k in ("cold_s", "warm_s")}))
    record.finish(run, report, args.out)


if __name__ == "__main__":
    main()
