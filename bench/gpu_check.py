"""Issue 35's device run in one command: exactness, speed, graphs, reservation, EC handoff, one JSON.

    python bench/gpu_check.py [--device cuda] [--small] [--parts ...] [--out DIR] [--repeats R]

bench/gpu_check.sh runs the CUDA unit tests and then this (its header holds the device tool's command). Two
towers, weights from the demo's seed (shapes, not embeddings): Qwen2.5-VL-7B's vision_config and
Qwen3-VL-8B's (DeepStack levels 8/16/24). --small: tiny towers and shapes on the CPU, the suite's dry run
(tests/integration/test_gpu_check.py). Parts, each written to <out>/gpu_check.json as soon as it is done:
  exact    vitserve vs HF in float32 (TF32 off; within 1e-5 relative) and bfloat16 (against HF float32, with
           HF bf16 vs HF float32 as the noise floor), eager and through the CUDA graphs;
  profile  the top CUDA kernels of one vitserve bf16 forward (7B, 8,192 tokens of 448 px), their share;
  speed    img/s of HF one image at a time, HF packed, vitserve eager, vitserve graphs (+ compiled blocks
           with --compile); MFU = matmul FLOPs / median time / the bf16 torch.mm peak measured here;
  latency  one 448 px image alone: HF, vitserve eager, vitserve graphs (the smallest bucket);
  reserve  bench/gpu_reserve.py at 4,096 / 8,192 / 16,384 tokens (method "full", published / peak), then
           the graphs captured and the worst case served through them: published + pool vs the peak; then
           --visual_mem_gb at G (the 16,384-token published peak) and 1.5 G: the budgets chosen;
  handoff  one embedding of width 16,384 in bf16 to the EC producer path: device to host, safetensors
           file written and renamed (vLLM's ECExampleConnector layout), for 256 and 2,700 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import gpu  # noqa: E402
from bench import gpu_check_parts as parts
from vitserve.checkpoint import Checkpoint  # noqa: E402
from vitserve.families import FAMILIES  # noqa: E402
from vitserve.model import load_encoder  # noqa: E402
from vitserve.model.adapters import resolve_adapter  # noqa: E402
from vitserve.model.demo import seeded_visual  # noqa: E402
from vitserve.model.encoder import HFVisionEncoder  # noqa: E402
from vitserve.model.tower_graphs import TowerRunner  # noqa: E402
from vitserve.model.weights import rebuild_rope_buffers  # noqa: E402

# Qwen3-VL-8B-Instruct's config.json vision_config (the tower's shape; weights here are random)
QWEN3_8B = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
    "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
}  # fmt: skip
QWEN3_TINY = {**QWEN3_8B, "depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4,
              "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 2]}  # fmt: skip
TOWERS = {
    "qwen2_5_vl-7b": ("qwen2_5_vl", gpu.SEVEN_B, gpu.TINY),
    "qwen3_vl-8b": ("qwen3_vl", QWEN3_8B, QWEN3_TINY),
}
PARTS = ("exact", "profile", "speed", "latency", "reserve", "handoff")
GRAPH_BUCKETS = (1024, 2048, 4096, 8192, 16384)
SMALL_BUCKETS = (64, 256, 1024)


def checkpoint(model_type: str, vision: dict[str, Any]) -> Checkpoint:
    """The demo checkpoint (its seed) with this model_type and vision_config."""
    config = {"model_type": model_type, "vision_config": dict(vision)}
    family = FAMILIES[resolve_adapter(model_type).family]
    return dataclasses.replace(Checkpoint.demo(), name=f"{model_type}-shape", config=config, family=family)


def build(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> tuple[HFVisionEncoder, Any]:
    """(vitserve's encoder as a rank loads it, HF's tower with the same weights and rope buffers)."""
    enc = load_encoder(ckpt, device, dtype)
    adapter = resolve_adapter(ckpt.model_type)
    hf = seeded_visual(adapter, adapter.hf_config(ckpt.config), ckpt).to(device=device, dtype=dtype)
    rebuild_rope_buffers(hf, device)
    return enc, hf


class Run:
    """The run's settings and its results, written to <out>/gpu_check.json after every part."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.small = bool(args.small)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.buckets = SMALL_BUCKETS if self.small else GRAPH_BUCKETS
        self.results: dict[str, Any] = {"meta": parts.meta(self.device, args), "towers": {}}
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = args.out / "gpu_check.json"
        self._built: dict[tuple[str, torch.dtype], tuple[HFVisionEncoder, Any]] = {}

    def built(self, ckpt: Checkpoint, dtype: torch.dtype) -> tuple[HFVisionEncoder, Any]:
        """build(ckpt, device, dtype), kept for the next part of the same tower (one tower at a time)."""
        key = (ckpt.name, dtype)
        if key not in self._built:
            self._built.clear()
            parts.free(self.device)
            self._built[key] = build(ckpt, self.device, dtype)
        return self._built[key]

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1, default=str))

    def tower(self, name: str) -> dict[str, Any]:
        tower: dict[str, Any] = self.results["towers"].setdefault(name, {})
        return tower

    def runner(self, enc: HFVisionEncoder, capture: bool) -> tuple[TowerRunner, int]:
        """A TowerRunner for enc's tower, its graphs captured on CUDA (pool bytes), not installed."""
        runner = TowerRunner(enc.visual, self.buckets, compile_blocks=False)
        grown = 0
        if capture and self.device.type == "cuda":
            patch = _patch(enc)
            pixels, grid = gpu.inputs(parts.px([(4, 4)] if self.small else [(16, 16)], patch), patch)
            with torch.inference_mode():
                runner.forward(pixels.to(self.device, self.dtype), grid.to(self.device))  # varlen probe
                grown = runner.capture(self.dtype)
        return runner, grown


def _patch(enc: HFVisionEncoder) -> int:
    return int(enc.visual.config.patch_size)


def part_exact(run: Run, name: str, ckpt: Checkpoint) -> None:
    """fp32 (eager: no varlen kernel in fp32) and the serving dtype (eager, and graphs on CUDA) vs HF."""
    rows: list[dict[str, Any]] = []
    ref32: dict[str, torch.Tensor] = {}
    dtypes = (torch.float32, run.dtype) if run.dtype != torch.float32 else (torch.float32,)
    for dtype in dtypes:
        enc, hf = run.built(ckpt, dtype)
        graphs = dtype != torch.float32 and run.device.type == "cuda"
        runner = run.runner(enc, capture=graphs)[0] if graphs else None
        rows += parts.exact_rows(enc, hf, dtype, ref32, _patch(enc), runner, run.small)
    run.tower(name)["exact"] = rows


def part_speed(run: Run, name: str, ckpt: Checkpoint, peak: float) -> None:
    enc, hf = run.built(ckpt, run.dtype)
    runner, _ = run.runner(enc, capture=True)
    compiled = None
    if run.args.compile and run.device.type == "cuda":  # compiled in the capture's warm-ups, then captured
        start = time.monotonic()
        compiled = TowerRunner(enc.visual, run.buckets, compile_blocks=True)
        with torch.inference_mode():
            compiled.capture(run.dtype)
        run.tower(name)["compile_and_capture_s"] = time.monotonic() - start
    budgets = [256] if run.small else [8192, 16384]
    patch = _patch(enc)
    one = parts.px([(4, 4)] if run.small else [(16, 16)], patch)  # 448 px at patch 14, 512 px at 16
    pool = {"448px": one, "mixed": parts.px(parts.MIXED_UNITS, patch)}
    if run.small:  # the dry run: one workload
        del pool["mixed"]
    rows = []
    for budget in budgets:
        for kind, sizes_pool in pool.items():
            sizes = gpu.fill(budget, sizes_pool, patch)
            row = parts.speed_row(enc, hf, runner, compiled, sizes, run.args.repeats, peak, ckpt)
            row["workload"] = f"{kind} {budget}"
            rows.append(row)
            print(f"speed {name} {row['workload']}: {parts.speed_line(row)}", flush=True)
    run.tower(name)["speed"] = rows
    latency = parts.speed_row(enc, hf, runner, None, one, 3 * run.args.repeats, peak, ckpt)
    run.tower(name)["latency"] = latency


def part_reserve(run: Run, ckpt: Checkpoint) -> None:
    from bench import gpu_reserve

    run._built.clear()
    parts.free(run.device)
    enc = load_encoder(ckpt, run.device, run.dtype)
    budgets = [64] if run.small else [4096, 8192, 16384]
    max_images = 16 if run.small else 64
    rows = gpu_reserve.run(enc, budgets, max_images=max_images, random_batches=run.args.random_batches)
    with_graphs = (
        parts.reserve_with_graphs(enc, run, rows[-1], max_images) if run.device.type == "cuda" else {}
    )
    run.results["reserve"] = {"eager": rows, "graphs": with_graphs}
    run.save()
    # G: the largest budget's published peak (the dry run: 4x, above a CPU heap's noise at 64 tokens)
    gb = rows[-1]["published_mib"] / 1024 * (4 if run.small else 1)
    run.results["reserve"]["visual_mem_gb"] = parts.memory_targets(enc, gb, max_images)
    del enc
    parts.free(run.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the point) or cpu (the dry run)")
    parser.add_argument("--small", action="store_true", help="tiny towers and shapes (the CPU dry run)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--towers", nargs="+", default=list(TOWERS), choices=list(TOWERS))
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per mode")
    parser.add_argument("--random-batches", type=int, default=6, help="reserve: random compositions served")
    parser.add_argument("--compile", action="store_true", help="speed: also torch.compile'd blocks (CUDA)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_check"))
    parser.add_argument("--commit", default=None, help="the commit, where the tree is no git checkout")
    args = parser.parse_args(argv)
    logging.getLogger("vitserve.model.demo").setLevel(logging.ERROR)  # the random-weights banner
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 (the exactness check)
    torch.backends.cudnn.allow_tf32 = False  # HF's patch embedding is a Conv3d
    if args.small:  # the dry run: every path once, in seconds
        args.repeats, args.random_batches = 1, 1
    run = Run(args)
    started = time.monotonic()
    peak = gpu.measure_peak(run.device, run.dtype, 1024 if run.small else 8192)
    run.results["meta"]["peak_flops"] = peak
    for name in args.towers:
        _tower_parts(run, name, peak)
    if "reserve" in args.parts:
        ckpt = checkpoint("qwen2_5_vl", gpu.TINY if run.small else gpu.SEVEN_B)
        _timed_part(run, "reserve", lambda: part_reserve(run, ckpt))
    if "handoff" in args.parts:
        _timed_part(run, "handoff", lambda: run.results.__setitem__("handoff", parts.handoff(run)))
    run.results["meta"]["seconds"] = time.monotonic() - started
    run.save()
    parts.print_summary(run.results)
    print(f"\nwrote {run.path}")
    return 0


def _tower_parts(run: Run, name: str, peak: float) -> None:
    model_type, vision, tiny = TOWERS[name]
    ckpt = checkpoint(model_type, tiny if run.small else vision)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("exact", lambda: part_exact(run, name, ckpt)),
        ("profile", lambda: parts.profile(run, name, ckpt)),
        ("speed", lambda: part_speed(run, name, ckpt, peak)),
    ]
    for part, step in steps:
        if part in run.args.parts and not (part == "profile" and name != "qwen2_5_vl-7b"):
            _timed_part(run, f"{name} {part}", step)


def _timed_part(run: Run, label: str, step: Callable[[], None]) -> None:
    start = time.monotonic()
    try:
        step()
    except Exception as exc:  # one part failing must not lose the others' figures
        logging.exception("part %s failed", label)
        run.results.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"
    run.results["meta"].setdefault("part_seconds", {})[label] = time.monotonic() - start
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {time.monotonic() - start:.1f} s", flush=True)
    run.save()
    gc.collect()


if __name__ == "__main__":
    raise SystemExit(main())
