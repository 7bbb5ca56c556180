"""On a GPU: a Qwen2.5-VL-7B-shaped tower through vitserve and through transformers' own forward.

    python bench/gpu.py [--device cuda] [--small] [--parts exact speed reserve] [--repeats R] [--out DIR]

The tower is Qwen2.5-VL-7B's vision_config (SEVEN_B), weights drawn from the demo's seed (random init: the
numbers here are about shapes, not embeddings), built as a rank builds it: `load_encoder` (seeded weights,
`fast.optimize`, the adapter's forward). The HF reference is the same seeded tower from the same builder
(vitserve.model.demo.seeded_visual), moved to the device with HF's forward untouched: same weights, same
rotary buffers, same inputs. --small swaps in a tiny tower and small shapes, to try the script on a CPU.
1. exact: vitserve vs HF, fp32 and bf16 (packed sizes, and one image alone): max abs and relative (max abs
   over max |reference|) difference of the merger output; HF bf16 vs HF fp32 is the bf16 noise floor. TF32
   is off (cuBLAS and cuDNN) so fp32 means fp32. The CUDA kernels each forward's attention ran are listed.
2. speed (bf16): img/s at a few patch budgets for HF one image at a time, HF packed, vitserve packed (the
   adapter's forward on device tensors) and vitserve encode() (host pixels in, rows out, as served); MFU =
   matmul FLOPs (bench/encoder.py's formula) / median time / a bf16 torch.mm peak measured in this run.
3. reserve (bf16): bench/gpu_reserve.py, the rank's reservation against the allocator's peak.
Appends its record to <out>/gpu.jsonl (bench/record.py) and prints RESULTS.md's tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import logging
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import gpu_reserve, record  # noqa: E402
from bench.encoder import matmul_flops  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402
from vitserve.contract import ProcessedImage  # noqa: E402
from vitserve.model import load_encoder  # noqa: E402
from vitserve.model.adapters import resolve_adapter  # noqa: E402
from vitserve.model.demo import seeded_visual  # noqa: E402
from vitserve.model.encoder import HFVisionEncoder  # noqa: E402
from vitserve.model.weights import rebuild_rope_buffers  # noqa: E402

# Qwen2.5-VL-7B-Instruct's config.json vision_config (the tower's shape; weights here are random)
SEVEN_B = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "patch_size": 14, "temporal_patch_size": 2,
    "spatial_merge_size": 2, "hidden_act": "silu", "in_chans": 3, "tokens_per_second": 2,
}  # fmt: skip
TINY = {**SEVEN_B, "depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4,
        "out_hidden_size": 64, "fullatt_block_indexes": [1, 3]}  # fmt: skip
SPEC_TFLOPS = 989.0  # H100 SXM dense bf16, NVIDIA's data sheet
# (width, height) in pixels, multiples of 28
EXACT_CASES = {"packed": [(448, 448), (224, 336), (644, 476), (812, 532)], "alone": [(448, 448)]}
MIXED = [(224, 224), (448, 336), (644, 476), (336, 672), (812, 532), (280, 280)]
MODES = ("hf_one_at_a_time", "hf_packed", "vitserve_packed", "vitserve_encode")
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|efficient|cutlass.*softmax", re.IGNORECASE)


def checkpoint(vision: dict[str, Any]) -> Checkpoint:
    """The demo checkpoint (its seed) with the given vision_config."""
    config = {"model_type": "qwen2_5_vl", "vision_config": dict(vision)}
    return dataclasses.replace(Checkpoint.demo(), name="qwen2_5_vl-7b-shape", config=config)


def build(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> tuple[HFVisionEncoder, Any]:
    """(vitserve's encoder as a rank loads it, HF's tower with the same weights and rope buffers)."""
    enc = load_encoder(ckpt, device, dtype)
    adapter = resolve_adapter(ckpt.model_type)
    hf = seeded_visual(adapter, adapter.hf_config(ckpt.config), ckpt).to(device=device, dtype=dtype)
    rebuild_rope_buffers(hf, device)  # float32, as load_encoder leaves them
    return enc, hf


def inputs(sizes: list[tuple[int, int]], patch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([(1, h // patch, w // patch) for w, h in sizes])  # (B, 3)
    n = int(grid.prod(-1).sum())
    return torch.randn(n, 3 * 2 * patch * patch, generator=torch.Generator().manual_seed(seed)), grid


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vs_forward(enc: HFVisionEncoder, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return enc.adapter.forward(enc.visual, pixels, grid)[0]


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, that over max |ref|), in float64 on the host."""
    a, b = out.double().cpu(), ref.double().cpu()
    diff = (a - b).abs().max().item()
    return diff, diff / b.abs().max().item()


def attention_kernels(device: torch.device, call: Callable[[], Any]) -> list[str]:
    """The distinct GPU kernels one call ran whose names say attention (empty off CUDA)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        sync(device)
    names = {e.key for e in prof.key_averages() if ATTENTION_KERNEL.search(e.key)}
    return sorted(n[:90] for n in names)


def exact_rows(enc: HFVisionEncoder, hf: Any, dtype: torch.dtype, ref32: dict[str, torch.Tensor],
               patch: int) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:  # fmt: skip
    """vitserve vs HF in `dtype`; in bf16 also each against HF fp32 (ref32, filled by the fp32 pass)."""
    rows, kernels, name = [], {}, str(dtype).removeprefix("torch.")
    device = enc.device
    with torch.inference_mode():
        for case, sizes in EXACT_CASES.items():
            pixels, grid = inputs(sizes, patch)
            pixels, grid = pixels.to(device, dtype), grid.to(device)
            out_vs, out_hf = vs_forward(enc, pixels, grid), hf(pixels, grid_thw=grid).pooler_output
            pairs = [(f"vitserve {name} vs HF {name}", out_vs, out_hf)]
            if dtype == torch.float32:
                ref32[case] = out_hf.float().cpu()
            else:
                pairs += [(f"HF {name} vs HF float32 (noise floor)", out_hf, ref32[case]),
                          (f"vitserve {name} vs HF float32", out_vs, ref32[case])]  # fmt: skip
            for label, out, ref in pairs:
                diff, rel = compare(out, ref)
                rows.append({"case": case, "images": len(sizes), "patches": pixels.shape[0], "dtype": name,
                             "comparison": label, "max_abs": diff, "max_rel": rel})  # fmt: skip
            if case == "packed":
                hf_call = functools.partial(hf, pixels, grid_thw=grid)
                kernels[f"HF {name}"] = attention_kernels(device, hf_call)
                vs_call = functools.partial(vs_forward, enc, pixels, grid)
                kernels[f"vitserve {name}"] = attention_kernels(device, vs_call)
    return rows, kernels


def fill(budget: int, pool: list[tuple[int, int]], patch: int) -> list[tuple[int, int]]:
    """Sizes cycled from `pool` while the total patch count stays within `budget`."""
    out: list[tuple[int, int]] = []
    used, k = 0, 0
    while True:
        w, h = pool[k % len(pool)]
        if used + (w // patch) * (h // patch) > budget:
            return out
        out.append((w, h))
        used, k = used + (w // patch) * (h // patch), k + 1


def timed(device: torch.device, call: Callable[[], Any]) -> float:
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


def speed_row(enc: HFVisionEncoder, hf: Any, name: str, sizes: list[tuple[int, int]], vision: dict[str, Any],
              repeats: int, peak: float) -> dict[str, Any]:  # fmt: skip
    device, patch = enc.device, vision["patch_size"]
    host_pixels, grid_cpu = inputs(sizes, patch)
    pixels, grid = host_pixels.to(device, enc.dtype), grid_cpu.to(device)
    counts = grid_cpu.prod(-1).tolist()
    singles = list(zip(torch.split(pixels, counts), grid[:, None], strict=True))
    items = [ProcessedImage(p, (1, int(g[1]), int(g[2])), int(g.prod()) // 4, (0, 0), False)
             for p, g in zip(torch.split(host_pixels, counts), grid_cpu, strict=True)]  # fmt: skip
    calls = {
        "hf_one_at_a_time": lambda: [hf(p, grid_thw=g).pooler_output for p, g in singles],
        "hf_packed": lambda: hf(pixels, grid_thw=grid).pooler_output,
        "vitserve_packed": lambda: vs_forward(enc, pixels, grid),
        "vitserve_encode": lambda: enc.encode(items),
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with torch.inference_mode():
        for call in calls.values():  # warm-up: kernels chosen, set-ups cached
            call(), call()
        for _ in range(repeats):
            for mode, call in calls.items():
                times[mode].append(timed(device, call))
    sec = {m: statistics.median(t) for m, t in times.items()}
    flops = matmul_flops(grid_cpu, vision)
    return {"workload": name, "images": len(sizes), "patches": sum(counts), "tflop": flops / 1e12,
            "seconds": sec, "images_per_s": {m: len(sizes) / s for m, s in sec.items()},
            "vs_hf_packed": sec["hf_packed"] / sec["vitserve_packed"],
            "vs_hf_one": sec["hf_one_at_a_time"] / sec["vitserve_packed"],
            "mfu_measured": flops / sec["vitserve_packed"] / peak,
            "mfu_spec": flops / sec["vitserve_packed"] / (SPEC_TFLOPS * 1e12),
            "mfu_hf_packed": flops / sec["hf_packed"] / peak}  # fmt: skip


def measure_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Median FLOP/s of a size^3 torch.mm in dtype on device, after three warm-ups."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    return 2 * size**3 / statistics.median(timed(device, lambda: torch.mm(a, b)) for _ in range(repeats))


def print_tables(results: dict[str, Any]) -> None:
    print("\n| inputs | comparison | max abs diff | max rel diff |\n|---|---|---|---|")
    for r in results["exact"]:
        print(f"| {r['case']} ({r['images']} img, {r['patches']} patches) | {r['comparison']} | "
              f"{r['max_abs']:.2e} | {r['max_rel']:.2e} |")  # fmt: skip
    for who, names in results["attention_kernels"].items():
        print(f"- attention kernels, {who}: {', '.join(names) or '(none named so)'}")
    peak = results["meta"]["peak_flops"]
    print(f"\nmeasured torch.mm peak: {peak / 1e12:.3g} TFLOP/s (spec {SPEC_TFLOPS:.0f})\n")
    print(
        "| workload | imgs | patches | TFLOP | HF one img/s | HF packed img/s | vitserve img/s | encode() img/s"
        " | x HF packed | x HF one | MFU (measured peak) | MFU (spec) | HF packed MFU |"
    )
    print("|---" * 13 + "|")
    for r in results["speed"]:
        ips = r["images_per_s"]
        print(
            f"| {r['workload']} | {r['images']} | {r['patches']} | {r['tflop']:.1f} | "
            f"{ips['hf_one_at_a_time']:.1f} | {ips['hf_packed']:.1f} | {ips['vitserve_packed']:.1f} | "
            f"{ips['vitserve_encode']:.1f} | {r['vs_hf_packed']:.2f}x | {r['vs_hf_one']:.2f}x | "
            f"{100 * r['mfu_measured']:.1f}% | {100 * r['mfu_spec']:.1f}% | {100 * r['mfu_hf_packed']:.1f}% |"
        )
    gpu_reserve.print_table(results["reserve"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the point) or cpu (to try the script)")
    parser.add_argument("--small", action="store_true", help="a tiny tower and small shapes (a CPU try-out)")
    parser.add_argument("--parts", nargs="+", default=["exact", "speed", "reserve"])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per mode")
    parser.add_argument(
        "--out", type=Path, default=None, help="where the run record goes (default bench/out)"
    )
    parser.add_argument("--random-batches", type=int, default=6, help="reserve: random compositions served")
    parser.add_argument("--commit", default=None, help="the commit, where the tree is no git checkout")
    args = parser.parse_args(argv)
    logging.getLogger("vitserve.model.demo").setLevel(logging.ERROR)  # the random-weights banner
    logging.basicConfig(level=logging.WARNING)
    run = record.begin("gpu", args)
    if args.commit:
        run["commit"], run["dirty"] = args.commit, False
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 (the exactness check)
    torch.backends.cudnn.allow_tf32 = False  # HF's patch embedding is a Conv3d
    vision = TINY if args.small else SEVEN_B
    ckpt = checkpoint(vision)
    serve_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, Any] = {"exact": [], "attention_kernels": {}, "speed": [], "reserve": []}
    peak = measure_peak(device, serve_dtype, 1024 if args.small else 8192)
    results["meta"] = {"vision_config": vision, "peak_flops": peak, "spec_tflops": SPEC_TFLOPS,
                       "repeats": args.repeats, "serve_dtype": str(serve_dtype)}  # fmt: skip
    ref32: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16) if "exact" in args.parts else (serve_dtype,):
        enc, hf = build(ckpt, device, dtype)
        results["meta"]["hf_attn_implementation"] = hf.config._attn_implementation
        if "exact" in args.parts:
            rows, kernels = exact_rows(enc, hf, dtype, ref32, vision["patch_size"])
            results["exact"] += rows
            results["attention_kernels"].update(kernels)
        if dtype == serve_dtype and "speed" in args.parts:
            budgets = [512, 1024] if args.small else [4096, 8192, 16384]
            for budget in budgets:
                for kind, pool in (
                    ("448px", [(448, 448)] if not args.small else [(112, 112)]),
                    ("mixed", MIXED),
                ):
                    sizes = fill(budget, pool, vision["patch_size"])
                    row = speed_row(enc, hf, f"{kind} {budget}", sizes, vision, args.repeats, peak)
                    results["speed"].append(row)
                    print(
                        f"speed {row['workload']}: vitserve {row['images_per_s']['vitserve_packed']:.1f} img/s, "
                        f"x{row['vs_hf_packed']:.2f} HF packed, MFU {100 * row['mfu_measured']:.1f}%",
                        flush=True,
                    )
        del hf
        if dtype == serve_dtype and "reserve" in args.parts:
            gc.collect()
            budgets = [64, 128, 256] if args.small else [4096, 8192, 16384]
            results["reserve"] = gpu_reserve.run(
                enc, budgets, max_images=64 if not args.small else 16, random_batches=args.random_batches
            )
        del enc
        gc.collect()
    results["meta"]["peak_flops"] = peak = max(
        peak, measure_peak(device, serve_dtype, 1024 if args.small else 8192)
    )
    for r in results["speed"]:  # against the better of the two peaks
        r["mfu_measured"] = r["tflop"] * 1e12 / r["seconds"]["vitserve_packed"] / peak
        r["mfu_hf_packed"] = r["tflop"] * 1e12 / r["seconds"]["hf_packed"] / peak
    if device.type == "cuda":
        results["meta"]["device_name"] = torch.cuda.get_device_name(device)
    print_tables(results)
    record.finish(run, results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
