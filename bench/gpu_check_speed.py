"""bench/gpu_check.py's speed part: a tower at production shape, eager and HF first, then the CUDA graphs.

Budgets count MERGED tokens, as --visual_batch_max_tokens does (a merged token is 4 patch rows): 4,096,
8,192 and 16,384, filled with 448 px images or a mixed set, at most 64 images a batch (the default
--visual_infer_batch_size); and one 1080p image alone (latency). Sizes are in merged units (w, h): one list
serves a patch-14 tower (28 px a unit) and a patch-16 one (32 px).

Two parts, each under its own timeout: speed times HF and vitserve eager (interleaved), each row saved as it
comes; graphs then captures those of a rank serving --visual_batch_max_tokens 16384 (vitserve/worker/
graphs.py's buckets and ladder) and times every workload through them, into the same rows. A capture that
fails is recorded under the tower's "graphs" and leaves the eager rows as they are. MFU is the shape's
matmul FLOPs over the median time over the in-run peak (apply_mfu, again once the peak is read at the end).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import gpu
from bench import gpu_check_shapes as shapes
from vitserve.model.encoder import HFVisionEncoder
from vitserve.model.fast_varlen import kernels_ran, reset_kernels_ran
from vitserve.model.tower_graphs import TowerRunner
from vitserve.worker.graphs import serving_buckets
from vitserve.worker.reservation import StressShape

BUDGETS = (16384, 8192, 4096)  # merged tokens; the headline first
SMALL_BUDGETS = (64,)
MAX_IMAGES = 64  # --visual_infer_batch_size's default
SERVING = StressShape(16384, MAX_IMAGES)  # the rank whose graphs are captured
SMALL_SERVING = StressShape(64, 16)
SMALL_MIXED = [(2, 2), (4, 3), (3, 5), (2, 4)]


def units_1080p(patch: int) -> tuple[int, int]:
    """1920 x 1080 as the Qwen processors resize it: each side rounded to the nearest merged unit."""
    return (round(1920 / (2 * patch)), round(1080 / (2 * patch)))


def workloads(patch: int, small: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    one, mixed = ([(4, 4)], SMALL_MIXED) if small else ([shapes.units_448(patch)], shapes.MIXED_UNITS)
    cap = 16 if small else MAX_IMAGES
    return [
        (f"{kind} {budget}", shapes.fill(budget, pool, cap))
        for budget in (SMALL_BUDGETS if small else BUDGETS)
        for kind, pool in (("448px", one), ("mixed", mixed))
    ]


class Batch:
    """One workload's inputs on the device, and what a row reports of its shape."""

    def __init__(self, enc: HFVisionEncoder, label: str, units: list[tuple[int, int]]) -> None:
        patch = int(enc.visual.config.patch_size)
        pixels, grid = gpu.inputs(shapes.px(units, patch), patch)
        self.label, self.grid_cpu = label, grid
        self.pixels, self.grid = pixels.to(enc.device, enc.dtype), grid.to(enc.device)
        self.tokens = sum(w * h for w, h in units)

    def row(self, ckpt: Any) -> dict[str, Any]:
        work = shapes.flops(self.grid_cpu, dict(ckpt.vision), ckpt.model_type)
        return {"workload": self.label, "images": len(self.grid_cpu), "tokens": self.tokens,
                "patches": int(self.pixels.shape[0]), "tflop": work / 1e12, "seconds": {}}  # fmt: skip


def part_speed(run: Any, name: str, ckpt: Any) -> None:
    """HF and vitserve eager on every workload and the 1080p image, each row saved as it comes."""
    enc, hf = run.built(ckpt, run.dtype)
    tower = run.tower(name)
    tower["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    tower["speed"] = []
    batches = _batches(enc, run.small)
    smallest_448 = [b for b in batches if b.label.startswith("448px")][-1]
    for batch in batches:
        row = _place(tower, batch.row(ckpt))
        repeats = run.args.repeats * (3 if batch.label == "1080p" else 1)
        row["attention"] = _eager_timings(enc, hf, batch, row, repeats, one=batch is smallest_448)
        apply_mfu(tower, run.peak())
        run.save()
        print(f"speed {name} {row['workload']}: {shapes.speed_line(row)}", flush=True)


def part_graphs(run: Any, name: str, ckpt: Any) -> None:
    """The graphs of a --visual_batch_max_tokens 16384 rank captured, then every workload through them, into
    the speed part's rows (made here where that part did not get to them). A failed capture is recorded
    under the tower's "graphs"; the eager rows are the speed part's and stand whatever happens here."""
    enc, _ = run.built(ckpt, run.dtype)
    tower = run.tower(name)
    runner = _capture(enc, run, tower)
    run.save()
    rows = {row["workload"]: row for row in _rows(tower)}
    for batch in _batches(enc, run.small):
        row = rows.get(batch.label) or _place(tower, batch.row(ckpt))
        _graph_timings(enc, runner, batch, row, run.args.repeats * (3 if batch.label == "1080p" else 1))
        apply_mfu(tower, run.peak())
        run.save()


def _place(tower: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """`row` in the tower: its latency row (the 1080p image), else one more speed row."""
    if row["workload"] == "1080p":
        tower["latency"] = row
    else:
        tower.setdefault("speed", []).append(row)
    return row


def _batches(enc: HFVisionEncoder, small: bool) -> list[Batch]:
    """Every workload's batch, the 1080p image last."""
    patch = int(enc.visual.config.patch_size)
    batches = [Batch(enc, label, units) for label, units in workloads(patch, small)]
    return [*batches, Batch(enc, "1080p", [(4, 3)] if small else [units_1080p(patch)])]


def _eager_timings(enc: HFVisionEncoder, hf: Any, batch: Batch, row: dict[str, Any], repeats: int,
                   one: bool) -> dict[str, int]:  # fmt: skip
    """HF packed (and one image at a time, `one`) and vitserve eager, interleaved, into row["seconds"];
    returns the attention kernels vitserve's forward ran (fast_varlen's count, per call)."""
    pixels, grid = batch.pixels, batch.grid
    calls: dict[str, Callable[[], Any]] = {
        "hf_packed": lambda: hf(pixels, grid_thw=grid).pooler_output,
        "vitserve_eager": lambda: enc.adapter.forward(enc.visual, pixels, grid)[0],
    }
    if one:
        singles = list(zip(torch.split(pixels, batch.grid_cpu.prod(-1).tolist()), grid[:, None], strict=True))
        calls["hf_one_at_a_time"] = lambda: [hf(p, grid_thw=g).pooler_output for p, g in singles]
    with torch.inference_mode():
        reset_kernels_ran()
        for call in calls.values():
            call()  # warm-up: kernels chosen, set-ups cached (and vitserve's attention calls counted)
        ran = kernels_ran()
        _time_into(row, calls, enc.device, repeats)
    return ran


def _time_into(row: dict[str, Any], calls: dict[str, Callable[[], Any]], device: Any, repeats: int) -> None:
    times: dict[str, list[float]] = {m: [] for m in calls}
    for _ in range(repeats):
        for mode, call in calls.items():
            times[mode].append(gpu.timed(torch.device(device), call))
    row["seconds"].update({m: statistics.median(t) for m, t in times.items()})


def _capture(enc: HFVisionEncoder, run: Any, tower: dict[str, Any]) -> TowerRunner:
    """The graphs of a --visual_batch_max_tokens 16384 rank, captured; tower["graphs"] says how it went."""
    shape = SMALL_SERVING if run.small else SERVING
    merge = int(enc.visual.spatial_merge_size)
    buckets, ladder = serving_buckets(shape, merge * merge)
    runner = TowerRunner(enc.visual, buckets, ladder)
    info: dict[str, Any] = {"visual_batch_max_tokens": shape.visual_batch_max_tokens, "buckets": buckets,
                            "image_ladder": ladder, "captured": 0, "pool_bytes": None, "error": None}  # fmt: skip
    tower["graphs"] = info
    start = time.monotonic()
    try:
        with torch.inference_mode():
            one = Batch(enc, "probe", [(2, 2)])
            runner.forward(one.pixels, one.grid)  # the varlen probe, outside any capture
            reset_kernels_ran()
            info["pool_bytes"] = runner.capture(enc.dtype)
        info["attention"] = kernels_ran()  # what the captured graphs replay
    except Exception as exc:  # noqa: BLE001 (recorded: the eager rows stand, the graphs' are skipped)
        info["error"] = f"{type(exc).__name__}: {exc}"
        runner.graphs.clear()
    info["captured"], info["capture_s"] = len(runner.graphs), time.monotonic() - start
    print(f"graphs {info}", flush=True)
    return runner


def _graph_timings(enc: HFVisionEncoder, runner: TowerRunner, batch: Batch, row: dict[str, Any],
                   repeats: int) -> None:  # fmt: skip
    """Through the captured graphs; without them (a failed capture) on the CPU the same padding run eagerly
    (the dry run's check of that path), on CUDA nothing."""
    if not runner.graphs and batch.pixels.is_cuda:
        return
    mode = "vitserve_graphs" if runner.graphs else "vitserve_padded"
    pad = not runner.graphs

    def call() -> torch.Tensor:
        return runner.forward(batch.pixels, batch.grid, pad_eagerly=pad)[0]

    with torch.inference_mode():
        out = call()
        row[f"{mode}_vs_eager_rel"] = gpu.compare(
            out, enc.adapter.forward(enc.visual, batch.pixels, batch.grid)[0]
        )[1]
        key = runner.key_for_grid(batch.grid_cpu, runner.graphs or runner.keys)
        row["graph_key"] = None if key is None else [key.bucket, key.full_slots, key.window_slots]
        _time_into(row, {mode: call}, enc.device, repeats)


def apply_mfu(tower: dict[str, Any], peak: float) -> None:
    """img/s, x HF packed and MFU (the shape's FLOPs / median seconds / peak) of every row of a tower."""
    for row in _rows(tower):
        sec = row["seconds"]
        ours = [s for m, s in sec.items() if m.startswith("vitserve")]
        row["images_per_s"] = {m: row["images"] / s for m, s in sec.items()}
        row["mfu"] = {m: row["tflop"] * 1e12 / s / peak for m, s in sec.items() if m != "hf_one_at_a_time"}
        row["peak_flops"] = peak
        if ours and "hf_packed" in sec:
            row["x_hf_packed"] = sec["hf_packed"] / min(ours)


def _rows(tower: dict[str, Any]) -> list[dict[str, Any]]:
    return [*tower.get("speed", []), *([tower["latency"]] if "latency" in tower else [])]
