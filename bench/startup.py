"""Start-up benchmark: the real CLI, `vitserve --model demo` at the default budget, cold and then warm.

    python bench/startup.py                    # one cold start (fresh runtime dir), then --warm warm starts
    python bench/startup.py --warm 3 --budget 8192
    python bench/startup.py --visual_mem_gb 0.5   # --visual_mem_gb cold, then its budget given directly, cold

With --visual_mem_gb: a cold start sizing the budget for it (fresh runtime dir), then a cold start with the
budget it chose given as --visual_batch_max_tokens (another fresh runtime dir), then --warm warm starts of the
first; the ratio of the two cold starts is issue 36's target (<= 2).

Cold: a fresh --runtime_dir, so the rank measures its reservation (docs/engine.md, "Start-up"). Warm: the
same runtime dir again, nothing changed, so the stored reservation is used and no stress runs. Each start
is timed from the process launch to the first `/ready` 200 (polled every 0.1 s), then stopped with SIGTERM.
The server's output is kept next to the record; the phase lines it prints ("vitserve [group 0] +4.1 s ...",
seconds since the rank started) are copied into the record, so a slow phase can be found. The record (commit, machine,
load before and after, each start with the load average it ran at) is appended to bench/out/startup.jsonl
(bench/harness.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness  # noqa: E402
from bench.loadgen import wait_ready  # noqa: E402
from tests.cli import Cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 900.0


def one_start(runtime_dir: Path, budget_args: list[str], log_path: Path, model: str = "demo") -> dict:
    """Launch the CLI, wait for /ready 200, stop it; seconds to ready, the budget it serves and the phase
    lines with their times. budget_args: ["--visual_batch_max_tokens", N] or ["--visual_mem_gb", G]."""
    port = harness.free_port()
    env = {**os.environ, "VITSERVE_RUNTIME_DIR": str(runtime_dir)}
    args = ["--model", model, "--port", str(port), *budget_args]
    start = time.monotonic()
    server = Cli(args, env=env, log=log_path)
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/ready", READY_TIMEOUT_S, server.proc, poll_s=0.1)
        ready_s = time.monotonic() - start
        info = httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=10).json()
    finally:
        with contextlib.suppress(AssertionError):  # killed after 60 s
            server.terminate(60)
        server.wait_exit(60)  # the log file is complete
    text = log_path.read_text()
    phases = [line for line in text.splitlines() if line.startswith("vitserve [group")]
    return {
        "ready_s": round(ready_s, 2),
        "budget_tokens": info["budget_tokens"],
        "budget_source": info["budget_source"],
        "loadavg": list(os.getloadavg()),
        "stress_skipped": any("stress: skipped" in line for line in phases),
        "phases": phases,
        "exit_code": server.proc.returncode,
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--budget", type=int, default=8192, help="--visual_batch_max_tokens (default 8192)")
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--model", default="demo", help="--model (default demo)")
    ap.add_argument("--visual_mem_gb", type=float, help="size the budget for this target (see above)")
    args = ap.parse_args()
    run = harness.begin("startup", args)
    if args.visual_mem_gb is not None:
        report = _mem_starts(args)
    else:
        with tempfile.TemporaryDirectory(prefix="vitserve-bench-rt-") as tmp:
            budget = ["--visual_batch_max_tokens", str(args.budget)]
            starts = _starts(Path(tmp), budget, args, ["cold"] + ["warm"] * args.warm, "startup")
        report = {
            "budget": args.budget,
            "starts": starts,
            "cold_s": starts[0]["ready_s"],
            "warm_s": [s["ready_s"] for s in starts[1:]],
        }
        print(json.dumps({k: report[k] for k in ("cold_s", "warm_s")}))
    harness.finish(run, report, args)


def _starts(
    runtime_dir: Path, budget: list[str], args: argparse.Namespace, kinds: list[str], tag: str
) -> list:
    starts = []
    for k, kind in enumerate(kinds):
        log = args.out / f"{tag}-{k}.log"
        result = {"kind": kind, **one_start(runtime_dir, budget, log, args.model)}
        print(
            f"{tag} {kind}: ready in {result['ready_s']} s, budget {result['budget_tokens']} "
            f"(load {result['loadavg'][0]:.2f})",
            flush=True,
        )
        starts.append(result)
    return starts


def _mem_starts(args: argparse.Namespace) -> dict:
    """--visual_mem_gb cold (and warm), then the budget it chose given directly, cold."""
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-rt-") as mem_dir:
        mem = ["--visual_mem_gb", str(args.visual_mem_gb)]
        sized = _starts(Path(mem_dir), mem, args, ["cold"], "startup-mem")
        budget = ["--visual_batch_max_tokens", str(sized[0]["budget_tokens"])]
        with tempfile.TemporaryDirectory(prefix="vitserve-bench-rt-") as flag_dir:
            given = _starts(Path(flag_dir), budget, args, ["cold"], "startup-flag")
        sized += _starts(Path(mem_dir), mem, args, ["warm"] * args.warm, "startup-mem-warm")
    report = {
        "visual_mem_gb": args.visual_mem_gb,
        "budget": sized[0]["budget_tokens"],
        "starts": sized + given,
        "mem_cold_s": sized[0]["ready_s"],
        "flag_cold_s": given[0]["ready_s"],
        "mem_warm_s": [s["ready_s"] for s in sized[1:]],
        "ratio": round(sized[0]["ready_s"] / given[0]["ready_s"], 2),
    }
    print(json.dumps({k: report[k] for k in ("budget", "mem_cold_s", "flag_cold_s", "mem_warm_s", "ratio")}))
    return report


if __name__ == "__main__":
    main()
