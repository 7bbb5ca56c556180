"""The measuring parts of bench/gpu_check.py (speed: gpu_check_speed.py; the shapes both measure:
gpu_check_shapes.py): exactness and its bf16 verdict, the kernel profile, the reservation with graphs
captured, --visual_mem_gb, the EC handoff, the printed summary.
Sizes are in merged units (w, h), so one list serves a patch-14 tower (x 28 px) and a patch-16 one (x 32 px).

The bf16 verdict. A bf16 forward differs from the float32 one by rounding (weights, activations, the
kernels' accumulation order); HF's own bf16 forward shows how much that is for this tower and these inputs.
vitserve's bf16 output passes when its error against HF float32, as an RMS over every output element
relative to the reference's RMS, is at most K_BF16 = 2 times HF bf16's. Why RMS and why 2: both forwards
start from the same bf16 weights and round as often, so their errors have the same scale; over ~10^6
elements the RMS concentrates (unlike the max, which picks one outlier of a different rounding path), so an
equally exact path reads within a few tens of percent of HF's, and 2x leaves room for our fp32 rotary and
flash's own accumulation order without hiding a real fault: a wrong window, offset or rotary puts whole
rows off by O(1) of the reference, i.e. an RMS tens of times bf16's ~4e-3."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import gpu
from bench.gpu_check_shapes import fill, px, speed_line, units_448
from vitserve.model.encoder import HFVisionEncoder
from vitserve.model.fast_varlen import kernels_ran, reset_kernels_ran
from vitserve.model.tower_graphs import TowerRunner

EXACT_UNITS = {"packed": [(16, 16), (8, 12), (23, 17), (29, 19)], "alone": [(16, 16)]}
SMALL_UNITS = {"packed": [(4, 4), (2, 3), (5, 3)], "alone": [(4, 4)]}
FP32_BOUND = 1e-5  # relative to max |reference|: float32 round-off through the tower
K_BF16 = 2.0  # vitserve bf16's RMS error against HF float32 <= K x HF bf16's (the module's docstring)
EC_WIDTH = 16384
EC_TOKENS = (256, 2700)  # one 448 px image; one 1080p image (shared VLLM-NOTES' hand-over row)


def meta(device: torch.device, args: Any) -> dict[str, Any]:
    import transformers

    out: dict[str, Any] = {
        "argv": vars(args) | {"out": str(args.out)}, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "load_before": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    from bench import record

    try:
        out |= record.git_state() | {"machine": record.machine()}
    except Exception:  # noqa: BLE001 (the device's copy of the tree has no .git: --commit says which)
        out["commit"] = None
    if args.commit:
        out |= {"commit": args.commit, "dirty": False}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {
            "device_name": props.name,
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    return out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _forward_all(enc: HFVisionEncoder, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
    merged, levels = enc.adapter.forward(enc.visual, pixels, grid)
    return [merged, *levels]


def errors(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict[str, float]:
    """max |out - ref|, that over max |ref|, and the RMS of out - ref over the RMS of ref: float64 on the
    host, the worst of the outputs (merged rows, DeepStack levels)."""
    worst = {"max_abs": 0.0, "max_rel": 0.0, "rms_rel": 0.0}
    for out, ref in zip(outs, refs, strict=True):
        a, b = out.double().cpu(), ref.double().cpu()
        diff = (a - b).abs()
        one = {"max_abs": diff.max().item(), "max_rel": diff.max().item() / b.abs().max().item(),
               "rms_rel": (diff.square().mean().sqrt() / b.square().mean().sqrt()).item()}  # fmt: skip
        worst = {k: max(v, one[k]) for k, v in worst.items()}
    return worst


def bf16_verdict(ours_rms: float, hf_rms: float, k: float = K_BF16) -> bool:
    """vitserve bf16 vs HF float32 within k times HF bf16 vs HF float32 (RMS, relative): the docstring's why."""
    return ours_rms <= k * hf_rms


def part_exact(run: Any, name: str, ckpt: Any) -> None:
    """float32 (eager: no varlen kernel in float32), then the serving dtype (eager, and graphs on CUDA) vs HF;
    rows saved as they come. A capture that fails is recorded under "exact_graphs"; the eager rows stand."""
    tower = run.tower(name)
    tower["exact"] = rows = []
    ref32: dict[str, list[torch.Tensor]] = {}
    patch = int(ckpt.vision["patch_size"])
    cases = {
        c: gpu.inputs(px(u, patch), patch) for c, u in (SMALL_UNITS if run.small else EXACT_UNITS).items()
    }
    for dtype in (torch.float32, run.dtype) if run.dtype != torch.float32 else (torch.float32,):
        enc, hf = run.built(ckpt, dtype)
        runner = None
        if dtype != torch.float32 and run.device.type == "cuda":
            runner, tower["exact_graphs"] = graphs_for(enc, [grid for _, grid in cases.values()])
        for case, (pixels, grid) in cases.items():
            rows += exact_rows(enc, hf, case, pixels, grid, ref32, runner)
            run.save()


def exact_rows(enc: HFVisionEncoder, hf: Any, case: str, pixels: torch.Tensor, grid: torch.Tensor,
               ref32: dict[str, list[torch.Tensor]], runner: TowerRunner | None) -> list[dict[str, Any]]:  # fmt: skip
    """vitserve (eager; graphs when a runner holds them) vs HF in enc's dtype, and against HF float32."""
    dtype = enc.dtype
    name = str(dtype).removeprefix("torch.")
    pixels, grid_dev = pixels.to(enc.device, dtype), grid.to(enc.device)
    with torch.inference_mode():
        out_hf = hf(pixels, grid_thw=grid_dev)
        hf_all = [out_hf.pooler_output, *(getattr(out_hf, "deepstack_features", None) or [])]
        mine = {"vitserve eager": _forward_all(enc, pixels, grid_dev)}
        if runner is not None and runner.graphs:
            merged, levels = runner.forward(pixels, grid_dev)
            mine["vitserve graphs"] = [merged, *levels]
    if dtype == torch.float32:
        ref32[case] = [t.float().cpu() for t in hf_all]
        pairs = [(f"{who} float32 vs HF float32", outs, hf_all) for who, outs in mine.items()]
    else:
        pairs = [(f"HF {name} vs HF float32 (noise floor)", hf_all, ref32[case])]
        pairs += [(f"{who} {name} vs HF float32", outs, ref32[case]) for who, outs in mine.items()]
        pairs += [(f"{who} {name} vs HF {name}", outs, hf_all) for who, outs in mine.items()]
    rows, floor = [], None
    for label, outs, refs in pairs:
        err = errors(outs, refs)
        floor = err["rms_rel"] if "noise floor" in label else floor
        judged = label.startswith("vitserve") and "HF float32" in label
        ok = None
        if judged:
            ok = (
                err["max_rel"] <= FP32_BOUND
                if dtype == torch.float32
                else bf16_verdict(err["rms_rel"], floor or 0.0)
            )
        rows.append({"case": case, "images": len(grid), "patches": int(pixels.shape[0]), "dtype": name,
                     "comparison": label, **err, "outputs": len(outs), "ok": ok,
                     "bound": None if not judged else FP32_BOUND if dtype == torch.float32 else K_BF16 * (floor or 0.0),
                     "bound_on": None if not judged else "max_rel" if dtype == torch.float32 else "rms_rel"})  # fmt: skip
    return rows


def graphs_for(enc: HFVisionEncoder, grids: list[torch.Tensor]) -> tuple[TowerRunner, dict[str, Any]]:
    """A runner with the graphs these batches take captured (a 16,384-token rank's buckets); what happened."""
    from vitserve.worker.graphs import serving_buckets
    from vitserve.worker.reservation import StressShape

    merge = int(enc.visual.spatial_merge_size)
    runner = TowerRunner(enc.visual, *serving_buckets(StressShape(16384, 64), merge * merge))
    keys = sorted({k for k in (runner.key_for_grid(g, runner.keys) for g in grids) if k is not None})
    info: dict[str, Any] = {"keys": [[k.bucket, k.full_slots, k.window_slots] for k in keys], "error": None}
    try:
        with torch.inference_mode():
            patch = int(enc.visual.config.patch_size)
            pixels, grid = gpu.inputs(px([(2, 2)], patch), patch)
            runner.forward(pixels.to(enc.device, enc.dtype), grid.to(enc.device))  # the varlen probe
            info["pool_bytes"] = runner.capture(enc.dtype, keys)
    except Exception as exc:  # noqa: BLE001 (recorded; the caller's eager rows stand)
        info["error"] = f"{type(exc).__name__}: {exc}"
        runner.graphs.clear()
    info["captured"] = len(runner.graphs)
    return runner, info


def profile(run: Any, name: str, ckpt: Any) -> None:
    """Top kernels of one vitserve forward at 8,192 merged tokens of 448 px: eager, then through the graphs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    enc, _ = run.built(ckpt, run.dtype)
    patch = int(enc.visual.config.patch_size)
    units = fill(128, [(4, 4)], 16) if run.small else fill(8192, [units_448(patch)], 64)
    pixels, grid_cpu = gpu.inputs(px(units, patch), patch)
    pixels, grid = pixels.to(run.device, run.dtype), grid_cpu.to(run.device)
    cuda = run.device.type == "cuda"
    out: dict[str, Any] = {"images": len(units), "patches": int(pixels.shape[0])}
    calls = {"eager": lambda: enc.adapter.forward(enc.visual, pixels, grid)}
    if cuda:
        runner, out["graphs_captured"] = graphs_for(enc, [grid_cpu])
        if runner.graphs:
            calls["graphs"] = lambda: runner.forward(pixels, grid)
    with torch.inference_mode():
        for label, call in calls.items():
            call(), call()
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with torch_profile(activities=activities) as prof:
                call()
                gpu.sync(run.device)
            attr = "self_device_time_total" if cuda else "self_cpu_time_total"
            events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
            total = sum(getattr(e, attr) for e in events) or 1.0
            top = sorted(events, key=lambda e: -getattr(e, attr))[:15]
            out[label] = {"total_us": total, "top": [
                {"kernel": e.key[:100], "us": getattr(e, attr), "share": getattr(e, attr) / total, "calls": e.count}
                for e in top]}  # fmt: skip
    run.tower(name)["profile"] = out


def reserve_with_graphs(
    enc: HFVisionEncoder, run: Any, row: dict[str, Any], max_images: int
) -> dict[str, Any]:
    """As a rank with --cuda_graphs: the graphs captured after the stress (worker/graphs.py: the published
    bytes grown by what the graphs hold, the reservation held again), then the worst case and random
    compositions of the budget served through them: published + pool against the peak reserved over the
    weights-only pool."""
    from bench import gpu_reserve
    from vitserve.worker.graphs import capture_for_serving
    from vitserve.worker.reservation import Method, Reservation, StressShape

    device, budget = enc.device, row["budget_tokens"]
    _, reserved0 = gpu_reserve._fresh(device)
    torch.cuda.reset_peak_memory_stats(device)
    stressed = Reservation(int(row["published_mib"] * 2**20), Method.FULL)
    published = capture_for_serving(enc, StressShape(budget, max_images), stressed, None).bytes
    served = 0
    reset_kernels_ran()  # a graph's replay counts nothing: what is counted ran eagerly (no graph held it)
    with torch.inference_mode():
        for _, make in gpu_reserve.serving_batches(enc, budget, max_images, budget, run.args.random_batches):
            enc.encode(make())
            served += 1
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - reserved0
    runner = enc.visual.__dict__.pop("_vitserve_runner", None)
    return {"budget_tokens": budget, "graphs": len(runner.graphs) if runner else 0,
            "pool_mib": (published - stressed.bytes) / 2**20, "published_plus_pool_mib": published / 2**20,
            "peak_reserved_mib": peak / 2**20, "ratio": published / peak if peak else None,
            "serving_batches": served, "eager_attention_calls": kernels_ran()}  # fmt: skip


def handoff(run: Any) -> list[dict[str, Any]]:
    """One embedding (tokens x 16,384, bf16) from the device to an EC file: D2H (pageable, pinned), the
    safetensors write to a temp name + rename (where vLLM's ECExampleConnector reads it); and the wire's GPU
    half at the other end (issue 39): vitserve's connector loading a held tensor from /dev/shm onto the device
    (`connector/store.py read_entry` + `.to(device)`, as its start_load_caches does). The send between the two is
    host work: bench/ec_handover.py measures it."""
    rows = []
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    for tokens in EC_TOKENS if not run.small else (16,):
        emb = torch.randn(tokens, EC_WIDTH if not run.small else 256, device=run.device).to(torch.bfloat16)
        pinned = torch.empty(emb.shape, dtype=emb.dtype, pin_memory=run.device.type == "cuda")
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            ms = {k: 1e3 * statistics.median(gpu.timed(run.device, f) for _ in range(7))
                  for k, f in _handoff_steps(emb, pinned, Path(tmp)).items()}  # fmt: skip
        mb = emb.numel() * emb.element_size() / 1e6
        rows.append({"tokens": tokens, "width": emb.shape[1], "mb": mb, "ms": ms,
                     "total_ms": ms["d2h_pinned"] + ms["file"], "wire_gpu_ms": ms["d2h_pinned"] + ms["wire_load"],
                     "dir": str(shm or tempfile.gettempdir())})  # fmt: skip
    return rows


def _handoff_steps(emb: torch.Tensor, pinned: torch.Tensor, folder: Path) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import save_file

    from vitserve.connector.store import read_entry

    def write() -> None:
        part = folder / "encoder_cache.safetensors.tmp"
        save_file({"ec_cache": pinned}, str(part))
        os.replace(part, folder / "encoder_cache.safetensors")

    held = folder / "held"  # what the connector's receiver wrote for one uuid: the raw bf16 rows
    pinned.cpu().contiguous().view(torch.uint8).numpy().tofile(held)
    rows, width = emb.shape

    def wire_load() -> torch.Tensor:
        return read_entry(str(held), "bfloat16", rows, width).to(device=emb.device)

    return {"d2h_pageable": lambda: emb.cpu(), "d2h_pinned": lambda: pinned.copy_(emb), "file": write,
            "wire_load": wire_load}  # fmt: skip


def print_summary(results: dict[str, Any]) -> None:
    meta = results["meta"]
    print(f"\npeak torch.mm: {meta.get('peak_flops_before', 0) / 1e12:.0f} TFLOP/s before, "
          f"{meta.get('peak_flops_after', 0) / 1e12:.0f} after")  # fmt: skip
    for name, tower in results["towers"].items():
        print(f"{name}: HF attention {tower.get('hf_attn_implementation')}, graphs {tower.get('graphs')}")
        for r in tower.get("speed", []) + ([tower["latency"]] if "latency" in tower else []):
            print(
                f"speed {name} {r['workload']} ({r['tokens']} tokens): {speed_line(r)}; ran {r.get('attention')}"
            )
        for r in tower.get("exact", []):
            print(f"exact {name} {r['case']}: {r['comparison']}: rms {r['rms_rel']:.2e} max {r['max_rel']:.2e} "
                  f"ok={r['ok']}")  # fmt: skip
    reserve = results.get("reserve", {})
    for r in reserve.get("eager", []):
        print(f"reserve {r['budget_tokens']}: {r['method']}, published/peak {r['published_over_peak']:.3f}")
    if reserve.get("graphs"):
        g = reserve["graphs"]
        print(
            f"reserve with graphs {g['budget_tokens']}: pool {g['pool_mib']:.0f} MiB, ratio {g['ratio']:.3f}"
        )
    for r in results.get("visual_mem_gb", []):
        print(f"--visual_mem_gb {r['visual_mem_gb']:.3f}: {r['budget_tokens']} tokens ({r['gib']:.3f} GiB)")
    for r in results.get("handoff", []):
        print(f"handoff {r['tokens']}x{r['width']} bf16 ({r['mb']:.1f} MB): {r['ms']}")
    for label, err in results.get("errors", {}).items():
        print(f"ERROR {label}: {err}")


def memory_targets(enc: HFVisionEncoder, gb: float, max_images: int, rows: list[dict[str, Any]],
                   save: Callable[[], None]) -> None:  # fmt: skip
    """--visual_mem_gb at gb and 1.5 x gb (issue 36: the larger target must choose the larger budget), each
    searched from a pool that holds only the weights, as a fresh rank's: budget, validated peak, method, time;
    each row appended to `rows` and saved as it comes."""
    from vitserve.config import GIB, Config
    from vitserve.worker.reservation import StressShape, sizing

    for target in (gb, 1.5 * gb):
        cfg = Config(visual_mem_gb=target, visual_batch_max_tokens=0, budget_source="visual_mem_gb",
                     visual_infer_batch_size=max_images)  # fmt: skip
        shape = StressShape(0, max_images, max_image_tokens=16384, min_image_tokens=4)
        knobs = sizing.Knobs.of(cfg, enc, shape)
        free(torch.device(enc.device))
        start = time.monotonic()
        with torch.inference_mode():
            res = sizing.size_for_memory(enc, shape, knobs, lambda: sizing.fresh_meter(enc.device), print)
        rows.append({"visual_mem_gb": target, "budget_tokens": res.budget_tokens, "gib": res.bytes / GIB,
                     "method": res.method.value, "seconds": time.monotonic() - start})  # fmt: skip
        save()
        print(f"visual_mem_gb {target:.3f}: {rows[-1]}", flush=True)
