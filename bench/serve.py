"""End-to-end serving benchmark: vitserve vs the naive baseline server, same run, same model, same load.

    python bench/serve.py --quick              # a smoke run, about a minute (small and mixed, 1 and 8 clients)
    python bench/serve.py                      # the standard profile, RESULTS.md's (budget 1024, 1/8/16 clients)
    python bench/serve.py --full               # the full sweep (budget 2048, longer points)
    python bench/report.py                     # plots and the RESULTS.md table from the latest run

Starts `vitserve --model demo` (the real CLI, a subprocess on a free 127.0.0.1 port), then
bench/baseline_server.py, and drives both with a concurrency sweep on three generated workloads, each point
run on both servers back to back (alternating which goes first) so both see the same background load.
Then measures encoder-only throughput in-process (vitserve.model.load_encoder("demo").encode) on the same
processed images packed into full-budget FIFO batches, the ceiling the service can reach:
service overhead = 1 - best e2e images/s / encoder-only images/s.
Everything is bounded: each point stops issuing after its duration or request cap; servers are stopped with
SIGTERM (then SIGKILL). Each run appends its record (commit, machine, load before and after, arguments, every
point with the load average it ran at) to bench/out/serve.jsonl (gitignored; bench/record.py); server logs go
next to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.loadgen import batch_delta, json_bodies, run_point, scrape_batch_metrics, wait_ready  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from tests.cli import CLI, Cli  # noqa: E402

# (images generated, concurrencies, seconds per point, request cap per point) per workload
# How long a server may take to become ready. On the shared 2-core VM at load average ~16, vitserve's worker
# was still loading after 300 s (2026-11-23); on a quiet machine it takes seconds.
READY_TIMEOUT_S = 900

# (the serving targets are read at 8 clients, and at 1 client for latency)
PROFILES = {
    "quick": {
        "budget": 1024,
        "small": (8, (1, 8), 5, 40),
        "mixed": (4, (1, 8), 5, 8),
        "large": (1, (1,), 5, 1),
    },
    "standard": {
        "budget": 1024,
        "small": (24, (1, 8, 16), 20, 400),
        "mixed": (8, (1, 8, 16), 20, 20),
        "large": (3, (1, 4), 20, 8),
    },
    "full": {
        "budget": 2048,
        "small": (64, (1, 4, 16, 64), 30, 2000),
        "mixed": (16, (1, 4, 16), 60, 200),
        "large": (6, (1, 4, 16), 60, 100),
    },
}


def server_command(
    kind: str, port: int, budget: int, threads: int, runtime_dir: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """The argv of one server; ``extra``: more vitserve flags (bench/scaling.py's --dp / --tp)."""
    if kind == "vitserve":
        # the benchmark measures throughput, not admission control: room for every client's request
        return [*CLI, "--model", "demo", "--host", "127.0.0.1", "--port", str(port), "--visual_batch_max_tokens",
                str(budget), "--max_queue_tokens", str(64 * budget), "--runtime_dir", runtime_dir,
                "--log_level", "warning", *extra]  # fmt: skip
    return [sys.executable, str(ROOT / "bench" / "baseline_server.py"), "--port", str(port), "--budget", str(budget),
            "--threads", str(threads)]  # fmt: skip


@contextlib.contextmanager
def launched(
    kind: str,
    budget: int,
    threads: int,
    log_path: Path,
    extra: tuple[str, ...] = (),
    tree: Path = ROOT,
    env: dict[str, str] | None = None,
):
    """Run one server as a subprocess; yield its URL once ready; always stop it.

    ``tree``: the checkout whose code it runs (bench/latency.py --before points it at an older tree);
    ``env``: variables set for the server on top of this process's environment.
    """
    port = harness.free_port()
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-") as runtime_dir:
        server = Cli(
            server_command(kind, port, budget, threads, runtime_dir, extra), env=env, command=(), cwd=tree,
            log=log_path,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, "/ready" if kind == "vitserve" else "/health", READY_TIMEOUT_S, server.proc)
            yield url
        finally:
            with contextlib.suppress(AssertionError):  # killed after 60 s: nothing more to do
                server.terminate(60)


def bench_servers(kinds: list[str], bodies: dict, profile: dict, threads: int, out_dir: Path) -> dict:
    """Start every server (one after the other), then run each point on each server back to back.

    Interleaving the servers point by point (alternating which goes first) means both see the same
    background load on a shared machine; an idle server costs nothing but memory.
    """
    results: dict = {kind: {} for kind in kinds}
    with contextlib.ExitStack() as stack:
        urls = {
            kind: stack.enter_context(launched(kind, profile["budget"], threads, out_dir / f"{kind}.log"))
            for kind in kinds
        }
        flip = False
        for workload, wl_bodies in bodies.items():
            _, concurrencies, duration, cap = profile[workload]
            for kind in kinds:  # warm-up (unmeasured): lazy init, allocator growth
                asyncio.run(
                    run_point(
                        urls[kind],
                        wl_bodies[:4],
                        concurrency=1,
                        duration_s=duration,
                        max_requests=4,
                        timeout_s=600,
                    )
                )
                results[kind][workload] = []
            for conc in concurrencies:
                for kind in kinds[::-1] if flip else kinds:
                    row = measure_point(kind, urls[kind], workload, wl_bodies, conc, duration, cap)
                    results[kind][workload].append(row)
                flip = not flip
    for kind in kinds:  # rows in concurrency order whatever order they ran in
        for rows in results[kind].values():
            rows.sort(key=lambda r: r["concurrency"])
    return results


def measure_point(
    kind: str, url: str, workload: str, bodies: list[bytes], conc: int, duration: float, cap: int
) -> dict:
    before = scrape_batch_metrics(url)
    point = asyncio.run(
        run_point(url, bodies, concurrency=conc, duration_s=duration, max_requests=cap, timeout_s=600)
    )
    row = {**point.summary(), **batch_delta(before, scrape_batch_metrics(url)), "loadavg": os.getloadavg()[0]}
    print(
        f"[{kind}] {workload:5s} c={conc:<3d} {row['images_per_s']:.3f} img/s "
        f"p50={_fmt(row['p50_s'])} p99={_fmt(row['p99_s'])} fill={_fmt(row['mean_batch_fill_ratio'])} "
        f"errors={row['errors']} load={row['loadavg']:.1f}",
        flush=True,
    )
    return row


def encoder_only(
    images: dict[str, list[bytes]], budget: int, threads: int, reps: int, force_fast: bool
) -> dict:
    """Images/s of load_encoder("demo").encode on full-budget FIFO batches of the same processed images.

    force_fast: apply vitserve.model.fast.optimize if load_encoder did not (a what-if while it is not wired).
    """
    import torch

    from vitserve.engine.scheduler import Scheduler
    from vitserve.images import decode_image
    from vitserve.model import load_encoder
    from vitserve.processors import load_image_processor

    torch.set_num_threads(threads)
    encoder = load_encoder("demo")
    processor = load_image_processor("demo", budget_tokens=budget)
    out: dict = {"fast_kernels_in_load_encoder": _has_fast(encoder.visual)}
    if force_fast and not out["fast_kernels_in_load_encoder"]:
        from vitserve.model.fast import optimize

        optimize(encoder.visual, "qwen2_5_vl")
    out["fast_kernels"] = _has_fast(encoder.visual)
    for workload, blobs in images.items():
        items = [processor.preprocess(decode_image(b, max_image_pixels=0).image) for b in blobs]
        sched = Scheduler(budget, 64)
        for i, item in enumerate(items):
            sched.add(i, item.num_tokens)
        batches = []
        while (batch := sched.next_batch()) is not None:
            batches.append([items[i] for i in batch])
        # warm-up pass: every batch shape once (first-shape costs, as the server's warm-up)
        for batch in batches:
            encoder.encode(batch)
        t0 = time.perf_counter()
        for _ in range(reps):
            for batch in batches:
                encoder.encode(batch)
        seconds = time.perf_counter() - t0
        out[workload] = {
            "images_per_s": reps * len(items) / seconds,
            "batches": len(batches),
            "mean_batch_fill_ratio": sum(it.num_tokens for it in items) / (len(batches) * budget),
            "tokens_per_image": sum(it.num_tokens for it in items) / len(items),
        }
        print(
            f"[encoder-only fast={out['fast_kernels']}] {workload:5s} {out[workload]['images_per_s']:.3f} img/s "
            f"({len(batches)} batches, fill {out[workload]['mean_batch_fill_ratio']:.2f})",
            flush=True,
        )
    return out


def _has_fast(visual) -> bool:
    return any(hasattr(m, "_vitserve_plans") for m in visual.modules())  # set by fast.optimize


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def summarize(servers: dict, enc: dict) -> dict:
    """Speed-up vitserve/baseline at each workload's best point, overhead vs encoder-only, fill at saturation."""
    out = {}
    for workload in enc:
        if not isinstance(enc[workload], dict) or workload not in servers.get("vitserve", {}):
            continue
        v = max(servers["vitserve"][workload], key=lambda r: r["images_per_s"])
        b = max(
            servers.get("baseline", {}).get(workload, [{"images_per_s": 0}]), key=lambda r: r["images_per_s"]
        )
        sat = servers["vitserve"][workload][-1]  # highest concurrency
        out[workload] = {
            "vitserve_best_images_per_s": v["images_per_s"],
            "baseline_best_images_per_s": b["images_per_s"],
            "speedup": v["images_per_s"] / b["images_per_s"] if b["images_per_s"] else None,
            "encoder_only_images_per_s": enc[workload]["images_per_s"],
            "e2e_over_encoder_only": v["images_per_s"] / enc[workload]["images_per_s"],
            "service_overhead": 1 - v["images_per_s"] / enc[workload]["images_per_s"],
            "fill_at_saturation": sat["mean_batch_fill_ratio"],
        }
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="the smoke profile (about a minute on 2 cores)")
    ap.add_argument("--full", action="store_true", help="the full sweep (budget 2048, 4-64 clients)")
    ap.add_argument("--budget", type=int, help="--visual_batch_max_tokens (default: 1024; 2048 with --full)")
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, os.cpu_count() or 1),
        help="torch threads of the baseline and the encoder-only run; vitserve's worker uses "
        "cpu_count // (tp*dp), i.e. the same with tp=dp=1",
    )
    ap.add_argument(
        "--workloads", default=None, help="comma list (default: small,mixed with --quick, else all)"
    )
    ap.add_argument("--servers", default="vitserve,baseline", help="comma list, or 'none' for encoder-only")
    ap.add_argument("--reps", type=int, default=1, help="encoder-only repetitions over each workload")
    args = ap.parse_args()
    name = "quick" if args.quick else "full" if args.full else "standard"
    profile = dict(PROFILES[name])
    if args.budget:
        profile["budget"] = args.budget
    run = harness.begin("serve", args)  # the code the servers start with (the tree may change in a long run)

    workloads = (args.workloads or ("small,mixed" if args.quick else "small,mixed,large")).split(",")
    images = {w: WORKLOADS[w](profile[w][0]) for w in workloads}
    bodies = {w: json_bodies(images[w]) for w in workloads}
    kinds = [k for k in args.servers.split(",") if k and k != "none"]  # "none": encoder-only
    servers = bench_servers(kinds, bodies, profile, args.threads, args.out) if kinds else {}
    enc = encoder_only(images, profile["budget"], args.threads, args.reps, force_fast=False)
    enc_fast = (
        enc
        if enc["fast_kernels"]
        else encoder_only(images, profile["budget"], args.threads, args.reps, force_fast=True)
    )
    report = {
        "profile": name,
        "budget": profile["budget"],
        "torch_threads": args.threads,
        "workload_params": {w: profile[w] for w in workloads},
        "servers": servers,
        "encoder_only": enc,
        "encoder_only_fast": enc_fast,
        "summary": summarize(servers, enc),
    }
    print(json.dumps(report["summary"], indent=1))
    harness.finish(run, report, args)


if __name__ == "__main__":
    main()
