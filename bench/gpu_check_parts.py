"""The measuring parts of bench/gpu_check.py: exactness rows, kernel profile, speed rows, the reservation with
graphs captured, the EC handoff, the printed summary. Sizes are in merged patches (w, h), so one list serves
a patch-14 tower (x 28 px) and a patch-16 one (x 32 px)."""

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
from bench.encoder import matmul_flops
from vitserve.model.encoder import HFVisionEncoder
from vitserve.model.tower_graphs import TowerRunner

EXACT_UNITS = {"packed": [(16, 16), (8, 12), (23, 17), (29, 19)], "alone": [(16, 16)]}
SMALL_UNITS = {"packed": [(4, 4), (2, 3), (5, 3)], "alone": [(4, 4)]}
MIXED_UNITS = [(8, 8), (16, 12), (23, 17), (12, 24), (29, 19), (10, 10)]  # bench/gpu.py's MIXED at 28 px
FP32_BOUND = 1e-5  # relative to max |reference|: float32 round-off through the tower
EC_WIDTH = 16384
EC_TOKENS = (256, 2700)  # one 448 px image; one 1080p image (shared VLLM-NOTES' hand-over row)


def px(units: list[tuple[int, int]], patch: int) -> list[tuple[int, int]]:
    return [(w * 2 * patch, h * 2 * patch) for w, h in units]


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


def exact_rows(enc: HFVisionEncoder, hf: Any, dtype: torch.dtype, ref32: dict[str, list[torch.Tensor]],
               patch: int, runner: TowerRunner | None, small: bool) -> list[dict[str, Any]]:  # fmt: skip
    """vitserve (eager; graphs when a runner is given) vs HF in `dtype`, and against HF float32 (ref32)."""
    rows: list[dict[str, Any]] = []
    name = str(dtype).removeprefix("torch.")
    with torch.inference_mode():
        for case, units in (SMALL_UNITS if small else EXACT_UNITS).items():
            pixels, grid = gpu.inputs(px(units, patch), patch)
            pixels, grid = pixels.to(enc.device, dtype), grid.to(enc.device)
            out_hf = hf(pixels, grid_thw=grid)
            hf_all = [out_hf.pooler_output, *(getattr(out_hf, "deepstack_features", None) or [])]
            mine = {"vitserve eager": _forward_all(enc, pixels, grid)}
            if runner is not None:
                merged, levels = runner.forward(pixels, grid)
                mine["vitserve graphs"] = [merged, *levels]
            if dtype == torch.float32:
                ref32[case] = [t.float().cpu() for t in hf_all]
                pairs = [(f"{who} float32 vs HF float32", outs, hf_all) for who, outs in mine.items()]
            else:
                pairs = [(f"HF {name} vs HF float32 (noise floor)", hf_all, ref32[case])]
                pairs += [(f"{who} {name} vs HF float32", outs, ref32[case]) for who, outs in mine.items()]
                pairs += [(f"{who} {name} vs HF {name}", outs, hf_all) for who, outs in mine.items()]
            floor = None
            for label, outs, refs in pairs:
                diff, rel = max(
                    (gpu.compare(o, r) for o, r in zip(outs, refs, strict=True)), key=lambda c: c[1]
                )
                floor = rel if "noise floor" in label else floor
                ok = rel <= FP32_BOUND if dtype == torch.float32 else (floor is not None and rel <= floor)
                rows.append({"case": case, "images": len(units), "patches": pixels.shape[0], "dtype": name,
                             "comparison": label, "max_abs": diff, "max_rel": rel,
                             "outputs": len(outs), "ok": bool(ok) if label.startswith("vitserve") and "HF float32" in label else None})  # fmt: skip
    return rows


def profile(run: Any, name: str, ckpt: Any) -> None:
    """Top kernels of one vitserve forward at 8,192 tokens of 448 px: eager, then through the graphs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    enc, _ = run.built(ckpt, run.dtype)
    patch = int(enc.visual.config.patch_size)
    sizes = gpu.fill(512 if run.small else 8192, px([(16, 16)] if not run.small else [(4, 4)], patch), patch)
    pixels, grid = gpu.inputs(sizes, patch)
    pixels, grid = pixels.to(run.device, run.dtype), grid.to(run.device)
    runner, _ = run.runner(enc, capture=True)
    cuda = run.device.type == "cuda"
    out: dict[str, Any] = {"images": len(sizes), "patches": int(pixels.shape[0])}
    calls = {
        "eager": lambda: enc.adapter.forward(enc.visual, pixels, grid),
        "graphs": lambda: runner.forward(pixels, grid),
    }
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


def flops(grid: torch.Tensor, vision: dict[str, Any], model_type: str) -> float:
    """Matmul FLOPs of one forward (2 per multiply-add); bench/encoder.py's formula for Qwen2.5-VL."""
    if model_type == "qwen2_5_vl":
        return matmul_flops(grid, vision)
    e, i, out, depth = (
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["out_hidden_size"],
        vision["depth"],
    )
    sizes = grid.prod(-1).tolist()
    n = sum(sizes)
    blocks = depth * (2 * n * (4 * e * e + 2 * e * i) + sum(4 * s * s * e for s in sizes))
    patch_embed = 2 * n * (3 * 2 * vision["patch_size"] ** 2) * e
    mergers = (1 + len(vision.get("deepstack_visual_indexes", []))) * 2 * (n // 4) * (4 * e) * (4 * e + out)
    return float(blocks + patch_embed + mergers)


def speed_row(enc: HFVisionEncoder, hf: Any, runner: TowerRunner, compiled: TowerRunner | None,
              sizes: list[tuple[int, int]], repeats: int, peak: float, ckpt: Any) -> dict[str, Any]:  # fmt: skip
    """Median seconds per mode (interleaved), img/s, x HF, MFU; the graphs' output checked against eager."""
    device, patch = enc.device, int(enc.visual.config.patch_size)
    pixels, grid = gpu.inputs(sizes, patch)
    grid_cpu, pixels, grid = grid, pixels.to(device, enc.dtype), grid.to(device)
    singles = list(zip(torch.split(pixels, grid_cpu.prod(-1).tolist()), grid[:, None], strict=True))
    calls: dict[str, Callable[[], Any]] = {
        "hf_one_at_a_time": lambda: [hf(p, grid_thw=g).pooler_output for p, g in singles],
        "hf_packed": lambda: hf(pixels, grid_thw=grid).pooler_output,
        "vitserve_eager": lambda: enc.adapter.forward(enc.visual, pixels, grid)[0],
        "vitserve_graphs": lambda: runner.forward(pixels, grid)[0],
    }
    if compiled is not None:
        calls["vitserve_compiled"] = lambda: compiled.forward(pixels, grid)[0]
    times: dict[str, list[float]] = {m: [] for m in calls}
    with torch.inference_mode():
        for call in calls.values():
            call(), call()
        for _ in range(repeats):
            for mode, call in calls.items():
                times[mode].append(gpu.timed(device, call))
        graphs_vs_eager = gpu.compare(calls["vitserve_graphs"](), calls["vitserve_eager"]())[1]
    sec = {m: statistics.median(t) for m, t in times.items()}
    work = flops(grid_cpu, dict(ckpt.vision), ckpt.model_type)
    key = runner.key_for(runner.stem(pixels, grid), runner.graphs) if runner.graphs else None
    return {"images": len(sizes), "patches": int(pixels.shape[0]), "tflop": work / 1e12, "seconds": sec,
            "images_per_s": {m: len(sizes) / s for m, s in sec.items()},
            "graph_key": None if key is None else list(dataclasses_tuple(key)),
            "graphs_vs_eager_rel": graphs_vs_eager,
            "x_hf_packed": sec["hf_packed"] / min(sec["vitserve_graphs"], sec["vitserve_eager"]),
            "x_hf_one": sec["hf_one_at_a_time"] / min(sec["vitserve_graphs"], sec["vitserve_eager"]),
            "mfu": {m: work / s / peak for m, s in sec.items() if m != "hf_one_at_a_time"}}  # fmt: skip


def dataclasses_tuple(key: Any) -> tuple[int, int, int]:
    return (key.bucket, key.full_slots, key.window_slots)


def speed_line(row: dict[str, Any]) -> str:
    ips, mfu = row["images_per_s"], row["mfu"]
    return (f"graphs {ips['vitserve_graphs']:.1f} img/s (MFU {100 * mfu['vitserve_graphs']:.1f}%), eager "
            f"{ips['vitserve_eager']:.1f} (MFU {100 * mfu['vitserve_eager']:.1f}%), HF packed {ips['hf_packed']:.1f}, "
            f"x{row['x_hf_packed']:.2f} HF packed")  # fmt: skip


def reserve_with_graphs(
    enc: HFVisionEncoder, run: Any, row: dict[str, Any], max_images: int
) -> dict[str, Any]:
    """As a rank with --cuda_graphs: the graphs captured after the stress (worker/graphs.py, the published
    bytes grown by the pool), then the worst case served through them, against the peak reserved over the
    pool before the capture."""
    from bench import gpu_reserve
    from vitserve.worker.graphs import capture_for_serving
    from vitserve.worker.reservation import Method, Reservation, StressShape

    device, budget = enc.device, row["budget_tokens"]
    _, reserved0 = gpu_reserve._fresh(device)
    torch.cuda.reset_peak_memory_stats(device)
    stressed = Reservation(int(row["published_mib"] * 2**20), Method.FULL)
    published = capture_for_serving(enc, StressShape(budget, max_images), stressed, None).bytes
    served = 0
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
            "serving_batches": served}  # fmt: skip


def handoff(run: Any) -> list[dict[str, Any]]:
    """One embedding (tokens x 16,384, bf16) from the device to an EC file: D2H (pageable, pinned), the
    safetensors write to a temp name + rename (where vLLM's ECExampleConnector reads it)."""
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
                     "total_ms": ms["d2h_pinned"] + ms["file"], "dir": str(shm or tempfile.gettempdir())})  # fmt: skip
    return rows


def _handoff_steps(emb: torch.Tensor, pinned: torch.Tensor, folder: Path) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import save_file

    def write() -> None:
        part = folder / "encoder_cache.safetensors.tmp"
        save_file({"ec_cache": pinned}, str(part))
        os.replace(part, folder / "encoder_cache.safetensors")

    return {"d2h_pageable": lambda: emb.cpu(), "d2h_pinned": lambda: pinned.copy_(emb), "file": write}


def print_summary(results: dict[str, Any]) -> None:
    print(f"\npeak bf16 torch.mm: {results['meta'].get('peak_flops', 0) / 1e12:.0f} TFLOP/s")
    for name, tower in results["towers"].items():
        for r in tower.get("exact", []):
            print(f"exact {name} {r['case']}: {r['comparison']}: rel {r['max_rel']:.2e} ok={r['ok']}")
        for r in tower.get("speed", []):
            print(f"speed {name} {r['workload']}: {speed_line(r)}")
        if "latency" in tower:
            sec = tower["latency"]["seconds"]
            print(f"latency {name} one 448px: " + ", ".join(f"{m} {1e3 * s:.2f} ms" for m, s in sec.items()))
    reserve = results.get("reserve", {})
    for r in reserve.get("eager", []):
        print(f"reserve {r['budget_tokens']}: {r['method']}, published/peak {r['published_over_peak']:.3f}")
    for r in reserve.get("visual_mem_gb", []):
        print(
            f"--visual_mem_gb {r['visual_mem_gb']:.3f}: {r['budget_tokens']} tokens ({r['gib']:.3f} GiB, {r['method']})"
        )
    if reserve.get("graphs"):
        g = reserve["graphs"]
        print(
            f"reserve with graphs {g['budget_tokens']}: pool {g['pool_mib']:.0f} MiB, ratio {g['ratio']:.3f}"
        )
    for r in results.get("handoff", []):
        print(f"handoff {r['tokens']}x{r['width']} bf16 ({r['mb']:.1f} MB): {r['ms']}")
    for label, err in results.get("errors", {}).items():
        print(f"ERROR {label}: {err}")


def memory_targets(enc: HFVisionEncoder, gb: float, max_images: int) -> list[dict[str, Any]]:
    """--visual_mem_gb at gb and 1.5 x gb (issue 36: the larger target must choose the larger budget), each
    searched from a pool that holds only the weights, as a fresh rank's: budget, validated peak, method, time."""
    from vitserve.config import GIB, Config
    from vitserve.worker.reservation import StressShape, sizing

    rows = []
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
        print(f"visual_mem_gb {target:.3f}: {rows[-1]}", flush=True)
    return rows
