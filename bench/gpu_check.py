"""Issue 40's device run in one command: speed at production shape, exactness, reservation, hand-off, one JSON.

    python bench/gpu_check.py [--device cuda] [--small] [--parts ...] [--out DIR] [--timeouts part=s ...]

bench/gpu_check.sh runs the CUDA unit tests and then this (its header holds the device tool's command). Two
towers, weights from the demo's seed (shapes, not embeddings): Qwen2.5-VL-7B's vision_config and
Qwen3-VL-8B's (DeepStack levels 8/16/24). --small: tiny towers and shapes on the CPU, the suite's dry run
(tests/integration/test_gpu_check.py). Parts, headline first; each row lands in <out>/gpu_check.json as soon
as it is measured (written atomically), and each part runs under its own timeout (--timeouts), so a part
that fails or overruns costs only its own rows:
  speed    per tower: batches of 16,384 / 8,192 / 4,096 MERGED tokens (448 px images, and a mixed set), at
           most 64 images (--visual_infer_batch_size's default), and one 1080p image (latency): HF's packed
           forward and vitserve eager (bench/gpu_check_speed.py);
  graphs   per tower, right after its speed part: the CUDA graphs of a --visual_batch_max_tokens 16384
           rank (worker/graphs.py's buckets) captured and the same workloads timed through them, into the
           same rows: a failed capture is recorded and the eager rows stand. MFU = the shape's matmul FLOPs / median time / the in-run bf16 torch.mm
           peak (measured before and after; the larger). The attention kernel that ran (counted by
           vitserve.model.fast_varlen), HF's attn implementation, the graph count and pool go in too;
  exact    per tower: vitserve vs HF in float32 (TF32 off; within 1e-5 relative), and in bfloat16 the
           verdict of gpu_check_parts.bf16_verdict (ours' error against HF float32 within K times HF bf16's);
  reserve  bench/gpu_reserve.py at 16,384 tokens (published / peak), then a --cuda_graphs rank's capture
           and the worst case served through the graphs: published + pool against the peak;
  visual_mem_gb  --visual_mem_gb at G (the 16,384-token published bytes) and 1.5 G: the budgets chosen;
  handoff  one embedding of width 16,384 in bf16 to the EC producer path (D2H, safetensors file, rename), and
           the wire connector's load of a held tensor onto the device (read_entry + H2D);
  profile  the top CUDA kernels of one 7B forward at 8,192 tokens of 448 px, eager and through the graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import gpu  # noqa: E402
from bench import gpu_check_parts as parts  # noqa: E402
from bench import gpu_check_speed as speed  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402
from vitserve.families import FAMILIES  # noqa: E402
from vitserve.model import load_encoder  # noqa: E402
from vitserve.model.adapters import resolve_adapter  # noqa: E402
from vitserve.model.demo import seeded_visual  # noqa: E402
from vitserve.model.encoder import HFVisionEncoder  # noqa: E402
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
PARTS = ("speed", "graphs", "exact", "reserve", "visual_mem_gb", "handoff", "profile")
# seconds per part (per tower for speed, graphs and exact) on an H200; gpu_check.sh passes them explicitly
TIMEOUTS = {
    "speed": 40,
    "graphs": 30,
    "exact": 15,
    "reserve": 35,
    "visual_mem_gb": 20,
    "handoff": 5,
    "profile": 10,
}
SMALL_TIMEOUT = 600.0  # --small (the CPU dry run, on a machine of any load): a hang's bound, not a budget


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


class PartTimeout(BaseException):
    """A part ran past its --timeouts seconds (raised in the main thread by SIGALRM); a BaseException, so
    a part's own `except Exception` (a capture's, recorded as its failure) does not take it for its own."""


class Run:
    """The run's settings and its results, written atomically to <out>/gpu_check.json as rows come."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.small = bool(args.small)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.results: dict[str, Any] = {"meta": parts.meta(self.device, args), "towers": {}}
        self.results["meta"]["part_timeouts"] = args.timeouts
        args.out.mkdir(parents=True, exist_ok=True)
        self.path = args.out / "gpu_check.json"
        self._built: dict[tuple[str, torch.dtype], tuple[HFVisionEncoder, Any]] = {}

    def ckpt(self, name: str) -> Checkpoint:
        model_type, vision, tiny = TOWERS[name]
        return checkpoint(model_type, tiny if self.small else vision)

    def built(self, ckpt: Checkpoint, dtype: torch.dtype) -> tuple[HFVisionEncoder, Any]:
        """build(ckpt, device, dtype), kept for later parts (the serving dtype of both towers stays)."""
        key = (ckpt.name, dtype)
        if key not in self._built:
            for old in [k for k in self._built if k[1] != self.dtype]:  # float32 towers: one at a time
                del self._built[old]
            parts.free(self.device)
            self._built[key] = build(ckpt, self.device, dtype)
        return self._built[key]

    def drop_built(self) -> None:
        self._built.clear()
        parts.free(self.device)

    def save(self) -> None:
        """The results so far, to a temp file renamed over the JSON: a reader never sees half a file."""
        part = self.path.with_name(self.path.name + ".tmp")
        part.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(part, self.path)

    def tower(self, name: str) -> dict[str, Any]:
        tower: dict[str, Any] = self.results["towers"].setdefault(name, {})
        return tower

    def peak(self) -> float:
        """The in-run bf16 (CPU: float32) torch.mm peak: the larger of the readings so far."""
        meta = self.results["meta"]
        return max(v for k, v in meta.items() if k.startswith("peak_flops_") and v)


def part_reserve(run: Run) -> None:
    from bench import gpu_reserve

    run.drop_built()
    ckpt = run.ckpt("qwen2_5_vl-7b")
    enc = load_encoder(ckpt, run.device, run.dtype)
    budget, max_images = (64, 16) if run.small else (16384, 64)
    run.results["reserve"] = reserve = {"eager": [], "graphs": {}}
    reserve["eager"] = gpu_reserve.run(enc, [budget], max_images, run.args.random_batches, model=run.small)
    run.save()
    if run.device.type == "cuda":
        reserve["graphs"] = parts.reserve_with_graphs(enc, run, reserve["eager"][-1], max_images)
    del enc
    parts.free(run.device)


def part_visual_mem_gb(run: Run) -> None:
    run.drop_built()
    enc = load_encoder(run.ckpt("qwen2_5_vl-7b"), run.device, run.dtype)
    rows = run.results.get("reserve", {}).get("eager") or []
    # G: the 16,384-token published bytes (the dry run: 4x its 64 tokens', above a CPU heap's noise); without
    # the reserve part, the 7B tower's figure at 16,384 tokens from the H200 run (bench/RESULTS.md)
    gb = rows[-1]["published_mib"] / 1024 * (4 if run.small else 1) if rows else (0.05 if run.small else 3.5)
    run.results["visual_mem_gb"] = []
    parts.memory_targets(enc, gb, 16 if run.small else 64, run.results["visual_mem_gb"], run.save)
    del enc
    parts.free(run.device)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("vitserve.model.fast_varlen", "vitserve.model.tower_graphs", "vitserve.worker.graphs"):
        logging.getLogger(name).setLevel(logging.INFO)  # which attention kernel serves; what the graphs hold
    logging.getLogger("vitserve.model.demo").setLevel(logging.ERROR)  # the random-weights banner
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 (the exactness check)
    torch.backends.cudnn.allow_tf32 = False  # HF's patch embedding is a Conv3d
    if args.small:  # the dry run: every path once, in seconds
        args.repeats, args.random_batches = 1, 1
    run = Run(args)
    started = time.monotonic()
    size = 1024 if run.small else 8192
    run.results["meta"]["peak_flops_before"] = gpu.measure_peak(run.device, run.dtype, size)
    for part, name, step in _steps(run):
        _timed_part(run, f"{name} {part}" if name else part, part, step)
    run.results["meta"]["peak_flops_after"] = gpu.measure_peak(run.device, run.dtype, size)
    run.results["meta"]["peak_flops"] = run.peak()
    for name in run.results["towers"]:
        speed.apply_mfu(run.tower(name), run.peak())  # every MFU against the in-run peak
    run.results["meta"]["seconds"] = time.monotonic() - started
    run.save()
    parts.print_summary(run.results)
    print(f"\nwrote {run.path}")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the point) or cpu (the dry run)")
    parser.add_argument("--small", action="store_true", help="tiny towers and shapes (the CPU dry run)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--towers", nargs="+", default=list(TOWERS), choices=list(TOWERS))
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per mode")
    parser.add_argument("--random-batches", type=int, default=3, help="reserve: random compositions served")
    parser.add_argument("--timeouts", nargs="*", default=[], metavar="PART=S", help="seconds per part")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_check"))
    parser.add_argument("--commit", default=None, help="the commit, where the tree is no git checkout")
    args = parser.parse_args(argv)
    given = dict(item.split("=", 1) for item in args.timeouts)
    if set(given) - set(PARTS):
        parser.error(f"--timeouts: unknown parts {sorted(set(given) - set(PARTS))}")
    default = dict.fromkeys(PARTS, SMALL_TIMEOUT) if args.small else TIMEOUTS
    args.timeouts = {p: float(given.get(p, default[p])) for p in PARTS}
    return args


def _steps(run: Run) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """(part, tower or "", step) in the order they run: the headline first."""
    chosen, towers = run.args.parts, run.args.towers
    for name in towers:  # the headline: each tower's speed, eager then through the graphs
        for part, fn in (("speed", speed.part_speed), ("graphs", speed.part_graphs)):
            if part in chosen:
                yield part, name, lambda fn=fn, name=name: fn(run, name, run.ckpt(name))
    if "exact" in chosen:
        for name in towers:
            yield "exact", name, lambda name=name: parts.part_exact(run, name, run.ckpt(name))
    if "reserve" in chosen:
        yield "reserve", "", lambda: part_reserve(run)
    if "visual_mem_gb" in chosen:
        yield "visual_mem_gb", "", lambda: part_visual_mem_gb(run)
    if "handoff" in chosen:
        yield "handoff", "", lambda: run.results.__setitem__("handoff", parts.handoff(run))
    if "profile" in chosen and "qwen2_5_vl-7b" in towers:
        yield (
            "profile",
            "qwen2_5_vl-7b",
            lambda: parts.profile(run, "qwen2_5_vl-7b", run.ckpt("qwen2_5_vl-7b")),
        )


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """PartTimeout raised in this (the main) thread after `seconds`; a hung device call is gpu_check.sh's
    outer timeout's to end."""

    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"past its {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timed_part(run: Run, label: str, part: str, step: Callable[[], None]) -> None:
    start = time.monotonic()
    try:
        with _deadline(run.args.timeouts[part]):
            step()
    except (Exception, PartTimeout) as exc:  # one part failing must not lose the others' figures
        logging.exception("part %s failed", label)
        run.results.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"
    run.results["meta"].setdefault("part_seconds", {})[label] = time.monotonic() - start
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {time.monotonic() - start:.1f} s", flush=True)
    run.save()
    gc.collect()


if __name__ == "__main__":
    raise SystemExit(main())
