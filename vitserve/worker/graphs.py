"""--cuda_graphs: the rank captures its tower's forward in CUDA graphs per token bucket at start-up.

After the reservation is measured (or adopted) and before it is published: the graphs' pool is memory the
rank holds for as long as it serves, so the published bytes grow by what the capture grew the CUDA pool by,
and so does the bound PeakWatch checks each batch against. Buckets: vitserve.model.buckets' defaults up to
the budget, the budget itself (a full batch pads to nothing); the image ladder up to --visual_infer_batch_size.
A batch no graph holds runs eagerly (vitserve/model/tower_graphs.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from vitserve.errors import ConfigError
from vitserve.model.buckets import DEFAULT_BUCKETS, DEFAULT_IMAGE_LADDER
from vitserve.worker.reservation import PeakWatch, Reservation, StressShape

log = logging.getLogger(__name__)


def serving_buckets(shape: StressShape) -> tuple[list[int], list[int]]:
    """(buckets, image ladder) for a rank serving under `shape` (budget 0: the default buckets)."""
    budget = shape.budget_tokens
    if budget <= 0:
        buckets = list(DEFAULT_BUCKETS)
    else:
        top = budget - budget % 4  # whole merge units
        buckets = sorted({b for b in DEFAULT_BUCKETS if b < top} | {top})
    ladder = sorted(
        {i for i in DEFAULT_IMAGE_LADDER if i < shape.max_batch_images} | {shape.max_batch_images}
    )
    return buckets, ladder


def capture_for_serving(
    encoder: Any, shape: StressShape, res: Reservation, watch: PeakWatch | None
) -> Reservation:
    """Capture the graphs, install them on the tower, and return `res` grown by the pool (watch likewise)."""
    from vitserve.model.tower_graphs import TowerRunner, install, supports

    visual = getattr(encoder, "visual", None)
    device = torch.device(encoder.device)
    if device.type != "cuda" or visual is None or not supports(visual):
        raise ConfigError(
            f"--cuda_graphs needs a Qwen tower on a CUDA device; this rank runs {encoder.family} on {device}"
        )
    buckets, ladder = serving_buckets(shape)
    runner = TowerRunner(visual, buckets, ladder)
    patch, merge = int(visual.config.patch_size), int(visual.spatial_merge_size)
    width = int(visual.config.in_channels) * int(visual.config.temporal_patch_size) * patch * patch
    side = 2 * merge  # one small image: runs the varlen probe and picks the kernels, outside any capture
    pixels = torch.zeros(side * side, width, dtype=encoder.dtype, device=device)
    grid = torch.tensor([[1, side, side]], device=device)
    with torch.inference_mode():
        runner.forward(pixels, grid)
        try:
            grown = runner.capture(encoder.dtype)
        except ValueError as exc:
            raise ConfigError(f"--cuda_graphs: {exc}; run without --cuda_graphs") from exc
    install(visual, runner)
    if watch is not None:
        watch.published += grown
    log.info("--cuda_graphs: %d graphs, buckets %s, %.0f MiB added to the reservation", len(runner.graphs),
             buckets, grown / 2**20)  # fmt: skip
    return dataclasses.replace(res, bytes=res.bytes + grown)
