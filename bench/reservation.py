"""How far the CPU serving peak rises above what the start-up reservation measured: the ratios that
vitserve/worker/reservation's HEAP_FACTOR and MODEL_FACTOR are chosen from (docs/engine.md, "The reservation").

    python bench/reservation.py                              # every tiny tower, seeds 1 and 2
    python bench/reservation.py --families qwen2_vl --budget 1024 --batches 60 --seeds 1

Each case runs in a fresh process (a fresh heap), as a rank would: the CPU allocator setting of the rank
(vitserve.model.fast_alloc), a tiny real checkpoint (tests/checkpoints.py) through the production encoder,
the stress shape from its real processor, then against one baseline taken after loading (meter.py):
1. the probes and the extrapolation (the first MIN_PROBES shapes: "predicted");
2. the whole full-budget stress (every batch of worst_case.stress_batches: "full");
3. --batches batches of random compositions the scheduler can form at the budget (seeded): "serving" is the
   peak RSS over everything, what the rank's PeakWatch compares with the published bytes.
One JSON line per case (ratios serving/full, serving/predicted, full/predicted), then the worst of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN_BUDGET = (
    2048  # the tiny Qwen towers' CPU attention is slow at 8192 (tests/integration/test_memory_model.py)
)
LIMITS = {"internvl": (8192, 512)}  # (budget, images); InternVL: 2048 tiles of 4 tokens


def one_case(family: str, budget: int, max_images: int, batches: int, seed: int) -> dict:
    """Runs inside its own process."""
    import random

    import torch

    from vitserve.model.fast_alloc import tune_cpu_allocator

    tune_cpu_allocator()  # first, like the rank: one arena, no mmap, no trimming
    from tests.checkpoints import make_checkpoint
    from vitserve.config import Config
    from vitserve.model import load_encoder
    from vitserve.processors import load_image_processor
    from vitserve.worker.reservation import StressShape, stress
    from vitserve.worker.reservation import memory_model as mm
    from vitserve.worker.reservation.meter import live_peak, meter_for
    from vitserve.worker.reservation.worst_case import worst_case_items, worst_case_units

    path = str(make_checkpoint(family, Path(tempfile.mkdtemp()) / family))
    enc = load_encoder(path)
    config = Config(model=path, visual_batch_max_tokens=budget, visual_infer_batch_size=max_images)
    shape = StressShape.of(config, load_image_processor(path, budget).clamp_info())
    units, _ = worst_case_units(enc, budget, max_images, **shape.bounds())
    meter = meter_for(enc.device)
    rng = random.Random(seed)
    with torch.inference_mode():
        est = mm.estimate(
            budget,
            mm.Shape.of_units(units),
            lambda b: stress._probe(enc, meter, shape, b, lambda line: None),
            fast_enough_s=0.0,
            max_probes=mm.MIN_PROBES,
            quadratic_memory=False,
        )
        assert est is not None
        full = meter.measure(lambda: stress.run_full(enc, shape, lambda line: None))
        for _ in range(batches):
            if shape.max_tiles_per_image:  # InternVL: tiles are encoded alone; only their grouping varies
                cap = rng.randint(1, shape.max_tiles_per_image)
                items = worst_case_items(enc, budget, max_images, max_tiles_per_image=cap)
            else:  # a random partition of the budget (or of less of it) into up to max_images images
                total = budget if rng.random() < 0.7 else rng.randint(max_images, budget)
                k = rng.randint(1, max_images)
                cuts = sorted(rng.sample(range(1, total), k - 1))
                parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
                items = [it for part in parts for it in worst_case_items(enc, part, 1)]
            enc.encode(items)
            del items  # one batch live at a time, as in the rank loop
    serving = live_peak(enc.device) - meter.baseline
    predicted = est.predicted_bytes
    mib = 2**20
    return {
        "family": family,
        "budget": budget,
        "batches": batches,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "predicted_mib": round(predicted / mib, 1),
        "full_mib": round(full / mib, 1),
        "serving_mib": round(serving / mib, 1),
        "serving_over_full": round(serving / full, 3),
        "serving_over_predicted": round(serving / predicted, 3),
        "full_over_predicted": round(full / predicted, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families", nargs="+", default=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl"]
    )
    parser.add_argument("--budget", type=int, default=QWEN_BUDGET, help="the Qwen towers' budget")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.case:
        family, budget, images, batches, seed = json.loads(args.case)
        print(json.dumps(one_case(family, budget, images, batches, seed)))
        return
    results = []
    for seed in args.seeds:
        for family in args.families:
            budget, images = LIMITS.get(family, (args.budget, 8))
            case = json.dumps([family, budget, images, args.batches, seed])
            out = subprocess.run(
                [sys.executable, __file__, "--case", case],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    for ratio in ("serving_over_full", "serving_over_predicted", "full_over_predicted"):
        print(f"worst {ratio}: {max(r[ratio] for r in results):.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
