"""bench/gpu.py's part 3: a rank's reservation for one tower against the allocator's peak while serving.

Per budget (merged tokens, --visual_batch_max_tokens), starting each from a pool that holds only the weights
(`empty_cache`, as a fresh rank):
1. `stress.measure`, the production path (the full-budget stress, or the memory model where that is slow):
   its published bytes;
2. serving: the worst-case batches (one image of the whole budget; max_images equal small images) and
   seeded random compositions of the budget, each through `encoder.encode` from host pixels, one batch live
   at a time; the peak growth of `max_memory_allocated` and of `max_memory_reserved` over the pool before 1;
3. the memory model's own extrapolation (probes up to budget/4, forced with fast_enough_s=0): its prediction
   and its reservation (x MODEL_FACTOR), against the same serving peak.
On a CPU (--small --device cpu) the meter is RSS and the same code runs, to try it.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import torch

from vitserve.model.base import Encoder
from vitserve.worker.reservation import StressShape, stress
from vitserve.worker.reservation import memory_model as mm
from vitserve.worker.reservation.meter import live_peak, meter_for
from vitserve.worker.reservation.worst_case import worst_case_items, worst_case_units

MAX_IMAGE_TOKENS = 16384  # the Qwen processors' default max_pixels / (patch * merge)^2
MIB = 2**20


def _fresh(device: torch.device) -> tuple[int, int]:
    """Free the pool's cached blocks (a fresh rank's pool holds only weights); (allocated, reserved)."""
    gc.collect()
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def serving_batches(
    enc: Encoder, budget: int, max_images: int, seed: int, random_batches: int
) -> list[tuple[str, list[Any]]]:
    """(label, builder) of the batches served: the worst cases, then random compositions of the budget."""
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = [
        ("one image of the budget", lambda: worst_case_items(enc, budget, 1)),
        (f"{max_images} equal images", lambda: worst_case_items(enc, budget // max_images, 1) * max_images),
    ]
    for _ in range(random_batches):
        k = rng.randint(2, max_images)
        cuts = sorted(rng.sample(range(1, budget), k - 1))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, budget], strict=True)]
        out.append((f"random {k} images", lambda parts=parts: [
            it for part in parts for it in worst_case_items(enc, part, 1)]))  # fmt: skip
    return out


def one_budget(
    enc: Encoder, budget: int, max_images: int, random_batches: int, model: bool = True
) -> dict[str, Any]:
    device = torch.device(enc.device)
    shape = StressShape(budget, max_images, max_image_tokens=MAX_IMAGE_TOKENS)
    allocated_before, reserved_before = _fresh(device)
    with torch.inference_mode():
        res = stress.measure(enc, shape)  # the production path
    held = 0  # what the pool holds over its baseline once the stress is over (CUDA)
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - reserved_before
        torch.cuda.reset_peak_memory_stats(device)
    for _, build in serving_batches(enc, budget, max_images, budget, random_batches):
        items = build()
        enc.encode(items)
        del items  # one batch live at a time, as in the rank loop
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak_alloc = torch.cuda.max_memory_allocated(device) - allocated_before
        peak_reserved = torch.cuda.max_memory_reserved(device) - reserved_before
    else:
        peak_alloc = peak_reserved = live_peak(device) - res.baseline
    _fresh(device)
    meter = meter_for(device)
    units, _ = worst_case_units(enc, budget, max_images, **shape.bounds())
    with torch.inference_mode():
        est = None if not model else mm.estimate(budget, mm.Shape.of_units(units),
                          lambda b: stress._probe(enc, meter, shape, b, lambda line: None),
                          fast_enough_s=0.0, quadratic_memory=mm.memory_fit_is_quadratic(device.type))  # fmt: skip
    peak = max(peak_alloc, peak_reserved)
    row = {
        "budget_tokens": budget, "max_images": max_images, "method": res.method.value,
        "published_mib": res.bytes / MIB, "held_mib": held / MIB, "peak_allocated_mib": peak_alloc / MIB,
        "peak_reserved_mib": peak_reserved / MIB, "serving_batches": 2 + random_batches, "published_over_peak": res.bytes / peak if peak else None,
        "model_probes": len(est.probes) if est else 0,
        "model_predicted_mib": est.predicted_bytes / MIB if est else None,
        "model_reserved_mib": est.reserved_bytes / MIB if est else None,
        "model_predicted_over_peak": est.predicted_bytes / peak if est and peak else None,
    }  # fmt: skip
    print(f"reserve {budget}: {row}", flush=True)
    return row


def run(
    enc: Encoder, budgets: list[int], max_images: int, random_batches: int, model: bool = True
) -> list[dict[str, Any]]:
    """one_budget per budget; model=False skips step 3 (the memory model's extrapolation)."""
    return [one_budget(enc, b, max_images, random_batches, model) for b in budgets]


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(
        "\n| budget (tokens) | method | published MiB | peak allocated MiB | peak reserved MiB | published / peak"
        " | model: predicted MiB (probes) | predicted / peak | model reservation MiB (x3) | pool held MiB |"
    )
    print("|---" * 10 + "|")
    for r in rows:
        ratio = r["published_over_peak"]
        pred = r["model_predicted_mib"]
        model = "- | - | - |"
        if pred is not None:
            model = (f"{pred:.0f} ({r['model_probes']}) | {r['model_predicted_over_peak']:.3f} | "
                     f"{r['model_reserved_mib']:.0f} |")  # fmt: skip
        print(f"| {r['budget_tokens']} | {r['method']} | {r['published_mib']:.0f} | {r['peak_allocated_mib']:.0f} | "
              f"{r['peak_reserved_mib']:.0f} | {ratio:.3f} | {model} {r.get('held_mib', 0):.0f} |")  # fmt: skip
