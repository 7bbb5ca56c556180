"""Encoder throughput: HF one image at a time vs HF packed vs vitserve packed (vitserve.model.fast).

    python bench/encoder.py [--quick] [--threads N] [--repeats R] [--out bench/out] [--no-tune-allocator]

One process, the seeded demo tower (vitserve.model.demo: Qwen2.5-VL layout, fp32), three workloads. Timings are medians
of R repeats after a warm-up, the three modes interleaved per repeat so that load from other processes
hits them alike. FLOP/s counts matmul FLOPs analytically (linear layers, patch embedding, attention
QK^T and AV) and is compared with a large fp32 torch.mm measured in the same run at the same thread count.

glibc's large-block mmap is turned off by optimize() for the whole process (vitserve/model/fast_alloc.py),
so by default the HF baselines run with it too: the ratios are the code's gain alone.
--no-tune-allocator keeps glibc's default for every mode.
Each run appends its record (commit, machine, load, arguments, rows) to bench/out/encoder.jsonl (bench/harness.py).
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.vision_utils import get_vision_window_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vitserve.model.fast as fast  # noqa: E402
from bench import harness  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402
from vitserve.model.demo import build_demo_visual  # noqa: E402
from vitserve.model.fast_linear import pack_linear_weights  # noqa: E402

DEMO = dict(Checkpoint.demo().vision)  # the demo tower's vision config
PATCH = DEMO["patch_size"]

# (width, height) in pixels, multiples of 28 so the grid is what the processor would produce.
WORKLOADS = {
    "small": [(224, 224)] * 8,
    "mixed": [(224, 224), (448, 336), (644, 476), (336, 672), (280, 280), (812, 532)],
    "large": [(896, 896)] * 2,  # 2 x 4096 patches = 8192 patches (2048 merged tokens)
}
QUICK = {  # a smoke run: ~1-2 min on 2 quiet cores (the standard run's large alone is 8x these patches)
    "small": [(224, 224)] * 4,
    "mixed": [(224, 224), (448, 336), (280, 448)],
    "large": [(504, 504)] * 2,
}
MODES = ("hf_one_at_a_time", "hf_packed", "vitserve_packed")


@dataclass
class Row:
    workload: str
    images: int
    patches: int
    gflop: float
    seconds: dict[str, float]  # median wall time per mode
    cpu_seconds: dict[str, float]  # median process CPU time per mode (less sensitive to being descheduled)
    images_per_s: dict[str, float]
    vs_hf_packed: float
    vs_hf_one: float
    peak_fraction: float  # vitserve packed FLOP/s / measured torch.mm FLOP/s
    max_abs_diff: float  # vitserve packed vs HF packed, pooler output


def demo_tower() -> nn.Module:
    """The demo model's tower (load_encoder("demo")), HF's forward untouched."""
    logging.getLogger("vitserve.model.demo").setLevel(logging.ERROR)  # its banner says what we know
    return build_demo_visual()


def make_inputs(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor([(1, h // PATCH, w // PATCH) for w, h in sizes])  # (B, 3)
    n = int(grid_thw.prod(-1).sum())
    pixels = torch.randn(n, 3 * 2 * PATCH * PATCH, generator=torch.Generator().manual_seed(1))
    return pixels, grid_thw


def matmul_flops(grid_thw: torch.Tensor, vision: dict | None = None) -> float:
    """FLOPs of the matmuls in one forward of a Qwen2.5-VL tower (2 per multiply-add); vision: its
    vision_config (default the demo's; bench/gpu.py passes the 7B's)."""
    cfg = DEMO if vision is None else vision
    e, i, out, depth = cfg["hidden_size"], cfg["intermediate_size"], cfg["out_hidden_size"], cfg["depth"]
    sizes = grid_thw.prod(-1).tolist()
    n = sum(sizes)
    _, cu_windows = get_vision_window_index(grid_thw, 2, cfg["window_size"], cfg["patch_size"])
    windows = (cu_windows[1:] - cu_windows[:-1]).tolist()
    per_layer_linear = 2 * n * (e * 3 * e + e * e + 3 * e * i)  # qkv, proj, gate/up/down
    full_attn = sum(4 * s * s * e for s in sizes)  # QK^T and AV over each image
    window_attn = sum(4 * s * s * e for s in windows)
    n_full = len(cfg["fullatt_block_indexes"])
    blocks = depth * per_layer_linear + n_full * full_attn + (depth - n_full) * window_attn
    patch_embed = 2 * n * (3 * 2 * cfg["patch_size"] ** 2) * e
    merger = 2 * (n // 4) * (4 * e) * (4 * e + out)
    return float(blocks + patch_embed + merger)


def measure_peak(threads: int, size: int = 4096, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    return 2 * size**3 / statistics.median(harness.timed(lambda: torch.mm(a, b), repeats))


def run_workload(name, sizes, hf, vs, repeats) -> Row:
    pixels, grid_thw = make_inputs(sizes)
    singles = list(zip(torch.split(pixels, grid_thw.prod(-1).tolist()), grid_thw[:, None], strict=True))
    calls = {
        "hf_one_at_a_time": lambda: [hf(p, g).pooler_output for p, g in singles],
        "hf_packed": lambda: hf(pixels, grid_thw).pooler_output,
        "vitserve_packed": lambda: vs(pixels, grid_thw).pooler_output,
    }
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    with torch.inference_mode():
        diff = (calls["vitserve_packed"]() - calls["hf_packed"]()).abs().max().item()  # also the warm-up
        calls["hf_one_at_a_time"]()
        for _ in range(repeats):
            for mode in MODES:
                start, start_cpu = time.perf_counter(), time.process_time()
                calls[mode]()
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
    sec = {mode: statistics.median(t) for mode, t in times.items()}
    flops = matmul_flops(grid_thw)
    return Row(
        workload=name, images=len(sizes), patches=pixels.shape[0], gflop=flops / 1e9, seconds=sec,
        cpu_seconds={mode: statistics.median(t) for mode, t in cpu.items()},
        images_per_s={mode: len(sizes) / s for mode, s in sec.items()},
        vs_hf_packed=sec["hf_packed"] / sec["vitserve_packed"],
        vs_hf_one=sec["hf_one_at_a_time"] / sec["vitserve_packed"],
        peak_fraction=0.0, max_abs_diff=diff,
    )  # fmt: skip


def print_table(rows: list[Row], peak: float, peak_size: int) -> None:
    print(f"matmul peak (fp32 torch.mm {peak_size}^2): {peak / 1e9:.1f} GFLOP/s")
    head = f"{'workload':8} {'imgs':>4} {'patches':>7} {'GFLOP':>6} | {'HF one img/s':>12} {'HF packed':>9} "
    head += f"{'vitserve':>9} | {'x HFpack':>8} {'x HFone':>7} | {'GFLOP/s':>7} {'%peak':>6} {'maxdiff':>8}"
    print(head)
    for r in rows:
        ips = r.images_per_s
        achieved = r.gflop / r.seconds["vitserve_packed"]
        print(
            f"{r.workload:8} {r.images:>4} {r.patches:>7} {r.gflop:>6.1f} | {ips['hf_one_at_a_time']:>12.2f} "
            f"{ips['hf_packed']:>9.2f} {ips['vitserve_packed']:>9.2f} | {r.vs_hf_packed:>7.2f}x {r.vs_hf_one:>6.2f}x"
            f" | {achieved:>7.1f} {100 * r.peak_fraction:>5.1f}% {r.max_abs_diff:>8.1e}"
        )
    print("CPU-time ratios (process_time medians): " + ", ".join(
        f"{r.workload}: x{r.cpu_seconds['hf_packed'] / r.cpu_seconds['vitserve_packed']:.2f} vs HF packed, "
        f"x{r.cpu_seconds['hf_one_at_a_time'] / r.cpu_seconds['vitserve_packed']:.2f} vs HF one" for r in rows
    ))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, quick="smaller workloads, 1 repeat (~1 min)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every mode")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per mode (default 5; quick 1)"
    )
    parser.add_argument("--no-tune-allocator", action="store_true", help="keep glibc's mmap for large blocks")
    args = parser.parse_args(argv)
    run = harness.begin("encoder", args)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 5)
    if args.no_tune_allocator:
        fast.tune_cpu_allocator = lambda: False  # type: ignore[assignment]
    hf = demo_tower()
    vs = fast.optimize(copy.deepcopy(hf), "qwen2_5_vl")
    pack_linear_weights(vs)  # as the rank does once its weights are final (vitserve/worker/rank.py)
    peak_size = 2048 if args.quick else 4096
    peak = measure_peak(args.threads, peak_size)
    rows = [run_workload(n, s, hf, vs, repeats) for n, s in (QUICK if args.quick else WORKLOADS).items()]
    peak = max(peak, measure_peak(args.threads, peak_size))  # again after the run: the better of the two
    for r in rows:
        r.peak_fraction = r.gflop * 1e9 / r.seconds["vitserve_packed"] / peak
    print(f"torch {torch.__version__}, threads {args.threads}, repeats {repeats}, "
          f"allocator tuned: {not args.no_tune_allocator}")  # fmt: skip
    print_table(rows, peak, peak_size)
    meta = {"threads": args.threads, "peak_matmul_size": peak_size, "repeats": repeats, "peak_flops": peak,
            "allocator_tuned": not args.no_tune_allocator, "demo": DEMO}  # fmt: skip
    harness.finish(run, {"meta": meta, "rows": [asdict(r) for r in rows]}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
