"""The CPU reservation holds the peak while serving (docs/design.md invariant 7), for every family at TP 1 and
2: real spawned gloo ranks, real tiny checkpoints, the production encoder and the production measurement
(vitserve/worker/reservation/stress.py and meter.py).

This is what MODEL_FACTOR and HEAP_FACTOR rest on. Each rank measures the production probes (the first
MIN_PROBES shapes, as on a slow CPU: 64, 128 and 256 tokens) and extrapolates, then runs the whole full-budget
stress (every composition of worst_case.stress_batches), then serves SERVE_BATCHES batches of random
compositions at the budget, all against the one baseline taken after loading (as PeakWatch counts). The
peak over all of it must stay within what either way publishes: the prediction times MODEL_FACTOR
(extrapolated) and the full stress's growth times HEAP_FACTOR (full). Publishing the prediction alone fails
it: the serving peak is above it on these towers (by a quarter on the tiny Qwen2.5-VL).

Budgets: InternVL 8192 tokens (an extrapolation by 32x, as for the demo at the default budget). The tiny
Qwen towers have a head dim of 8, for which CPU attention is slow and quadratic: a full-budget stress at
8192 tokens takes minutes, so they run at 2048 (8x); their full-budget growth is still 40-80 MiB, well
above RSS noise.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import FAMILIES, make_checkpoint
from tests.dist import run_ranks
from vitserve.worker.reservation import memory_model as mm
from vitserve.worker.reservation.memory_model import MODEL_FACTOR, Shape
from vitserve.worker.reservation.meter import HEAP_FACTOR

# (tokens, images) per batch. InternVL's tiny processor allows 5 tiles (4 tokens each) per image, so filling
# 8192 tokens (2048 tiles, 77 MB of pixels) takes 410 images.
LIMITS = {"internvl": (8192, 512)}
DEFAULT_LIMITS = (2048, 8)  # the Qwen families (see above)
SERVE_BATCHES = 8  # after the stress: the heap that batches of other shapes fragment is what raises the peak


def _serving_batch(enc, shape, rng: random.Random) -> list:
    """A batch the scheduler can form at the budget, of a random composition."""
    from vitserve.worker.reservation.worst_case import worst_case_items

    if shape.max_tiles_per_image:  # InternVL: every tile is encoded alone; only their grouping varies
        cap = rng.randint(1, shape.max_tiles_per_image)
        return worst_case_items(
            enc, shape.visual_batch_max_tokens, shape.visual_infer_batch_size, max_tiles_per_image=cap
        )
    budget, images = shape.visual_batch_max_tokens, rng.randint(1, shape.visual_infer_batch_size)
    cuts = sorted(rng.sample(range(1, budget), images - 1))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, budget], strict=True)]
    return [item for part in parts for item in worst_case_items(enc, part, 1)]  # one image of each part


def _probe_stress_serve(rank: int, world: int, path: str, budget: int, max_images: int) -> dict:
    from vitserve.config import Config
    from vitserve.model import load_encoder
    from vitserve.model.fast_alloc import tune_cpu_allocator
    from vitserve.model.tp import apply_tp
    from vitserve.processors import load_image_processor
    from vitserve.worker.reservation import StressShape, stress
    from vitserve.worker.reservation.meter import live_peak, meter_for
    from vitserve.worker.reservation.worst_case import worst_case_units

    tune_cpu_allocator()
    enc = load_encoder(path)
    if world > 1:
        apply_tp(enc.visual, enc.family)
    config = Config(model=path, visual_batch_max_tokens=budget, visual_infer_batch_size=max_images)
    shape = StressShape.of(config, load_image_processor(path, budget).clamp_info())
    units, _ = worst_case_units(enc, budget, max_images, **shape.bounds())
    meter = meter_for(enc.device)
    rng = random.Random(0)  # the same compositions on every TP rank
    with torch.inference_mode():
        est = mm.estimate(
            budget,
            Shape.of_units(units),
            lambda b: stress._probe(enc, meter, shape, b, lambda line: None),
            fast_enough_s=0.0,
            max_probes=mm.MIN_PROBES,
            quadratic_memory=mm.memory_fit_is_quadratic("cpu"),
        )
        assert est is not None
        full = meter.measure(lambda: stress.run_full(enc, shape, lambda line: None))
        for _ in range(SERVE_BATCHES):
            enc.encode(_serving_batch(enc, shape, rng))
    serving = live_peak(enc.device) - meter.baseline  # what PeakWatch compares with the published bytes
    probes = [(p.shape.tokens, p.bytes) for p in est.probes]
    return {"predicted": est.predicted_bytes, "full": full, "serving": serving, "probes": probes}


def _validate(family: str, tp: int, tmp_path) -> None:
    path = str(make_checkpoint(family, tmp_path / family))
    budget, max_images = LIMITS.get(family, DEFAULT_LIMITS)
    for got in run_ranks(_probe_stress_serve, tp, path, budget, max_images, timeout_s=120):
        predicted, full, serving = got["predicted"], got["full"], got["serving"]
        print(
            f"{family} tp{tp}: probes {got['probes']}, predicted {predicted}, full stress {full}, serving peak "
            f"{serving}: {full / predicted:.2f}x / {serving / predicted:.2f}x the prediction, "
            f"{serving / full:.2f}x the full stress"
        )
        assert full > 20 * 2**20, "the full-budget growth must stand well above RSS noise"
        assert serving <= predicted * MODEL_FACTOR, (
            f"{family} tp{tp}: extrapolated reservation under the peak"
        )
        assert serving <= full * HEAP_FACTOR, f"{family} tp{tp}: full-stress reservation under the peak"


@pytest.mark.parametrize(("family", "tp"), [("qwen2_5_vl", 1), ("internvl", 2)])
def test_the_reservation_holds_the_serving_peak(family, tp, tmp_path):
    _validate(family, tp, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_reservation_holds_the_serving_peak_for_every_family(family, tp, tmp_path):
    _validate(family, tp, tmp_path)
