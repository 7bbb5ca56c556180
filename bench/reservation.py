"""The CPU reservation against what really fits: the serving peak over the start-up measurement (the ratios
vitserve/worker/reservation's HEAP_FACTOR and MODEL_FACTOR are chosen from, docs/engine.md "The reservation"),
and, with --visual_mem_gb, the budget the search chooses against the largest budget that really fits.

    python bench/reservation.py                              # ratios: every tiny tower, seeds 1 and 2
    python bench/reservation.py --families qwen2_vl --budget 1024 --batches 60 --seeds 1
    python bench/reservation.py --model demo --budget 4096 --batches 20 --seeds 1   # the demo's ratios
    python bench/reservation.py --visual_mem_gb 2 4 6 --model demo --sittings 5 --load 2   # issue 52's sittings
    python bench/reservation.py --visual_mem_gb 2 4 6 --model demo --together --load 1     # the targets at once
    python bench/reservation.py --visual_mem_gb 0.2 --families qwen2_vl   # a tiny checkpoint (tests/checkpoints.py)
    python bench/reservation.py --quick                      # a smoke run: qwen2_vl, budget 1024, 2 batches, seed 1

Both run as a rank does: the CPU allocator setting of the rank (vitserve.model.fast_alloc), a tiny real
checkpoint through the production encoder (load_encoder), the stress shape from its real processor.

Ratios (record `reservation`), each case in a fresh process (a fresh heap), against one baseline taken after
loading (meter.py):
1. the probes and the extrapolation (the first MIN_PROBES shapes: "predicted");
2. the whole full-budget stress (every batch of worst_case.stress_batches: "full");
3. --batches batches of random compositions the scheduler can form at the budget (seeded): "serving" is the
   peak RSS over everything, what the rank's PeakWatch compares with the published bytes.
One JSON line per case (ratios serving/full, serving/predicted, full/predicted), then the worst of each.

--visual_mem_gb (record `visual_mem_gb`), fp32, each target in a fresh process with a fresh model record (an
independent start), --sittings times, with --load busy processes beside each sitting and `uptime` recorded (with
--together a sitting's targets run at once, so each loads the cores for the others; one after another without): the
search is vitserve/worker/reservation/sizing.py's size_for_memory, as a rank runs it. "Really fits" means the full-budget stress at that budget, measured as the
search measures it (a fresh meter; the published bytes), is within the target. The largest such budget is found
by bisection: first chosen / (1 - --tolerance) (over the target: the chosen budget is within tolerance), else
doubling while it fits, then halving the interval down to --tolerance of it. Each point is one stress (one reading of a noisy heap: every reading is in the record). Issue 36's
target: chosen >= 0.9 x largest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

QWEN_BUDGET = (
    2048  # the tiny Qwen towers' CPU attention is slow at 8192 (tests/integration/test_memory_model.py)
)
LIMITS = {"internvl": (8192, 512)}  # (budget, images); InternVL: 2048 tiles of 4 tokens
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl"]


def rank_encoder(model: str | None, family: str, tmp: Path) -> tuple[str, Any]:
    """(path, encoder): `model`, or a tiny checkpoint of `family`, loaded under a rank's heap settings."""
    from vitserve.model.fast_alloc import tune_cpu_allocator

    tune_cpu_allocator()  # first, like the rank (vitserve/worker/process.py): one arena, no mmap, no trimming
    from tests.checkpoints import make_checkpoint
    from vitserve.model import load_encoder

    path = model or str(make_checkpoint(family, tmp / family))
    return path, load_encoder(path)


def one_case(
    family: str, budget: int, max_images: int, batches: int, seed: int, model: str | None = None
) -> dict:
    """Runs inside its own process. `model`: a --model (e.g. demo) instead of the tiny tower of `family`."""
    import random

    path, enc = rank_encoder(model, family, Path(tempfile.mkdtemp()))  # first: the rank's heap settings
    import torch

    from vitserve.config import Config
    from vitserve.processors import load_image_processor
    from vitserve.worker.reservation import StressShape, stress
    from vitserve.worker.reservation import memory_model as mm
    from vitserve.worker.reservation.meter import heap_extent, live_peak, meter_for
    from vitserve.worker.reservation.worst_case import worst_case_items, worst_case_units

    config = Config(model=path, visual_batch_max_tokens=budget, visual_infer_batch_size=max_images)
    shape = StressShape.of(config, load_image_processor(path, budget).clamp_info())
    units, _ = worst_case_units(enc, budget, max_images, **shape.bounds())
    meter = meter_for(enc.device)
    extent = heap_extent()  # glibc's own count beside RSS: its growth over the probes, the stress, serving
    rng = random.Random(seed)
    with torch.inference_mode():
        est = mm.estimate(budget, mm.Shape.of_units(units),
                          lambda b: stress._probe(enc, meter, shape, b, lambda line: None),
                          fast_enough_s=0.0, max_probes=mm.MIN_PROBES, quadratic_memory=False)  # fmt: skip
        assert est is not None
        full = meter.measure(lambda: stress.run_full(enc, shape, lambda line: None))
        extent_full = heap_extent() - extent
        for _ in range(batches):
            if shape.max_tiles_per_image:  # InternVL: tiles are encoded alone; only their grouping varies
                cap = rng.randint(1, shape.max_tiles_per_image)
                items = worst_case_items(enc, budget, max_images, max_tiles_per_image=cap)
            else:  # a random partition of the budget (or of less of it) into up to max_images images
                total = budget if rng.random() < 0.7 else rng.randint(max_images, budget)
                cuts = sorted(rng.sample(range(1, total), rng.randint(1, max_images) - 1))
                parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
                items = [it for part in parts for it in worst_case_items(enc, part, 1)]
            enc.encode(items)
            del items  # one batch live at a time, as in the rank loop
    serving, predicted, mib = live_peak(enc.device) - meter.baseline, est.predicted_bytes, 2**20
    extent_serving = heap_extent() - extent
    return {"family": model or family, "budget": budget, "batches": batches, "seed": seed,
            "heap_extent_full_mib": round(extent_full / mib, 1), "heap_extent_serving_mib": round(extent_serving / mib, 1),
            "threads": torch.get_num_threads(), "predicted_mib": round(predicted / mib, 1),
            "full_mib": round(full / mib, 1), "serving_mib": round(serving / mib, 1),
            "serving_over_full": round(serving / full, 3), "serving_over_predicted": round(serving / predicted, 3),
            "full_over_predicted": round(full / predicted, 3)}  # fmt: skip


def ratios(args: argparse.Namespace) -> list[dict]:
    results = []
    for seed in args.seeds:
        for family in [None] if args.model else args.families:
            budget, images = LIMITS.get(family, (args.budget, 8))
            case = json.dumps([family, budget, images, args.batches, seed, args.model])
            out = subprocess.run([sys.executable, __file__, "--case", case], cwd=ROOT, capture_output=True,
                                 text=True, check=True)  # fmt: skip
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    for ratio in ("serving_over_full", "serving_over_predicted", "full_over_predicted"):
        print(f"worst {ratio}: {max(r[ratio] for r in results):.2f}")
    return results


def chosen_vs_largest(args: argparse.Namespace, target_gb: float, tmp: Path) -> dict:
    """One start's search for target_gb (a fresh model record: an independent start), then the bisection.
    Runs inside its own process (a fresh heap)."""
    model, enc = rank_encoder(args.model, args.families[0], tmp)  # first: the rank's heap settings
    import torch

    from vitserve.config import GIB, Config
    from vitserve.processors import load_image_processor
    from vitserve.worker.reservation import StressShape, sizing
    from vitserve.worker.reservation.budget_model import Record

    cfg = Config(model=model, visual_mem_gb=target_gb, visual_batch_max_tokens=0,
                 budget_source="visual_mem_gb", visual_infer_batch_size=args.batch)  # fmt: skip
    shape = StressShape.of(cfg, load_image_processor(model, budget_tokens=0).clamp_info())
    knobs = sizing.Knobs.of(cfg, enc, shape)
    lines: list[str] = []
    readings: list[tuple[int, float, float]] = []  # budget, published GiB, glibc's heap extent growth GiB

    def fits(budget: int) -> bool:
        meter = sizing.fresh_meter(enc.device)
        run = sizing._stress(enc, dataclasses.replace(shape, visual_batch_max_tokens=budget), meter)
        readings.append((budget, round(run.bytes / GIB, 4), round(getattr(meter, "heap_growth", 0) / GIB, 4)))
        print(f"  {budget} tokens: {run.bytes / GIB:.4f} GiB", flush=True)
        return run.bytes <= knobs.target_bytes

    start = time.monotonic()
    record = Record()
    with torch.inference_mode():
        res = sizing.size_for_memory(
            enc, shape, knobs, lambda: sizing.fresh_meter(enc.device), lines.append, record
        )
        search_s = time.monotonic() - start
        largest, fitted = _bisect(
            res.budget_tokens, fits, args.tolerance, lambda b: sizing._round(enc, shape, knobs, b)
        )
    report = {"model": args.model or f"tiny {args.families[0]}", "visual_mem_gb": target_gb,
              "chosen": res.budget_tokens, "chosen_gib": round(res.bytes / GIB, 4), "largest": largest,
              "largest_fitted": fitted, "ratio": round(res.budget_tokens / largest, 3), "search_s": round(search_s, 1),
              "sizing": res.sizing, "search": lines, "readings": readings,
              "points": [(p.budget, round(p.bytes / GIB, 4), p.kind) for p in record.points]}  # fmt: skip
    print(json.dumps({k: report[k] for k in ("visual_mem_gb", "chosen", "largest", "ratio", "search_s")}))
    return report


def _bisect(chosen: int, fits, tolerance: float, round_down) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
    """The largest budget that fits, from the chosen one (which the search validated), to within `tolerance`:
    first chosen / (1 - tolerance): over the target, the largest is below it, so the chosen one is within
    tolerance of it (returned, False: not itself measured to fit); within, doubling then halving the interval."""
    lo, hi = chosen, round_down(math.ceil(chosen / (1 - tolerance)))
    if hi <= lo or not fits(hi):
        return hi, False
    lo, hi = hi, None
    while hi is None and lo < 64 * chosen:
        candidate = round_down(lo * 2)
        lo, hi = (candidate, None) if fits(candidate) else (lo, candidate)
    if hi is None:
        return lo, True
    while hi - lo > max(tolerance * lo, 1):
        mid = round_down((lo + hi) // 2)
        if mid <= lo or mid >= hi:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, True


def sittings(args: argparse.Namespace) -> list[dict]:
    """--sittings of the targets, each target a fresh process, with --load busy processes running beside;
    with --together the targets of a sitting run at once, each the others' load."""
    out = []
    for k in range(args.sittings):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        try:
            uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            sitting: dict[str, Any] = {
                "sitting": k + 1,
                "uptime": uptime,
                "busy_processes": args.load,
                "together": args.together,
                "targets": [],
            }
            runs = [_target(args, gb) for gb in args.visual_mem_gb] if args.together else []
            for i, gb in enumerate(args.visual_mem_gb):
                run = runs[i] if runs else _target(args, gb)
                stdout, stderr = run.communicate()
                if run.returncode:
                    raise subprocess.CalledProcessError(run.returncode, run.args, stdout, stderr)
                sitting["targets"].append(json.loads(stdout.strip().splitlines()[-1]))
                print(json.dumps({k2: sitting["targets"][-1][k2] for k2 in ("visual_mem_gb", "chosen", "largest", "ratio")}),
                      flush=True)  # fmt: skip
            sitting["uptime_after"] = subprocess.run(
                ["uptime"], capture_output=True, text=True
            ).stdout.strip()
        finally:
            for p in busy:
                p.kill()
                p.wait()
        chosen = [t["chosen"] for t in sitting["targets"]]
        sitting["monotone"] = chosen == sorted(chosen)
        print(
            f"sitting {k + 1}: {sitting['uptime']}: budgets {chosen}, monotone {sitting['monotone']}",
            flush=True,
        )
        out.append(sitting)
    return out


def _target(args: argparse.Namespace, gb: float) -> subprocess.Popen:
    """One --visual_mem_gb target in a fresh process (an independent start), started."""
    from vitserve.cli import openmp_defaults

    env = dict(os.environ)
    openmp_defaults(env)  # a rank's OpenMP wait (the CLI sets it before the ranks start)
    case = json.dumps(
        {"gb": gb, **{a: getattr(args, a) for a in ("model", "families", "batch", "tolerance")}}
    )
    return subprocess.Popen([sys.executable, __file__, "--target_case", case], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def main() -> None:
    ap = harness.parser(__doc__, quick="qwen2_vl only, budget 1024, 2 batches, seed 1")
    ap.add_argument(
        "--families", nargs="+", default=FAMILIES, help="tiny towers (--visual_mem_gb: the first)"
    )
    ap.add_argument("--budget", type=int, default=QWEN_BUDGET, help="the Qwen towers' budget")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--visual_mem_gb", type=float, nargs="+", help="measure the search for these targets instead"
    )
    ap.add_argument("--sittings", type=int, default=1, help="with --visual_mem_gb: sittings of all targets")
    ap.add_argument(
        "--load", type=int, default=0, help="with --visual_mem_gb: busy processes beside each sitting"
    )
    ap.add_argument("--model", default=None, help="a --model (e.g. demo) instead of the tiny checkpoints")
    ap.add_argument("--batch", type=int, default=4, help="with --visual_mem_gb: --visual_infer_batch_size")
    ap.add_argument(
        "--together",
        action="store_true",
        help="with --visual_mem_gb: a sitting's targets at once, each the others' load",
    )
    ap.add_argument(
        "--tolerance", type=float, default=0.1, help="with --visual_mem_gb: bisection stops within"
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one ratios case in this process
    ap.add_argument("--target_case", help=argparse.SUPPRESS)  # internal: one --visual_mem_gb target
    args = ap.parse_args()
    if args.case:
        print(json.dumps(one_case(*json.loads(args.case))))
        return
    if args.target_case:
        case = json.loads(args.target_case)
        ns = argparse.Namespace(**{k: v for k, v in case.items() if k != "gb"})
        with tempfile.TemporaryDirectory(prefix="vitserve-bench-") as tmp:
            print(json.dumps(chosen_vs_largest(ns, case["gb"], Path(tmp))))
        return
    if args.quick:
        args.families, args.budget, args.batches, args.seeds = args.families[:1], 1024, 2, [1]
    run = harness.begin("reservation" if args.visual_mem_gb is None else "visual_mem_gb", args)
    if args.visual_mem_gb is None:
        results: Any = ratios(args)
    else:
        results = sittings(args)
    harness.finish(run, results, args)


if __name__ == "__main__":
    main()
