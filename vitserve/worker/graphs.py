"""--cuda_graphs: the rank captures its tower's forward in CUDA graphs per token bucket at start-up.

After the reservation is measured (or adopted) and before it is published: the graphs' pool is memory the
rank holds for as long as it serves, so the published bytes grow by what the graphs hold (their pool and
static buffers, read with the cached blocks released: tower_graphs.py), and so does the bound PeakWatch
checks each batch against; the reservation is then held again on top of them. Buckets (patch rows): vitserve.model.buckets'
defaults below the budget's rows (its merged tokens x merge**2), then those rows (a full batch pads to
nothing); the image ladder up to --visual_infer_batch_size. A batch no graph holds runs eagerly
(vitserve/model/tower_graphs.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from vitserve.errors import ConfigError
from vitserve.model.buckets import DEFAULT_BUCKETS, DEFAULT_IMAGE_LADDER, budget_rows
from vitserve.worker.reservation import PeakWatch, Reservation, StressShape
from vitserve.worker.reservation.meter import CudaMeter

log = logging.getLogger(__name__)


def serving_buckets(shape: StressShape, merge_unit: int) -> tuple[list[int], list[int]]:
    """(buckets in patch rows, image ladder) for a rank serving under `shape` (budget 0: the default buckets).

    The budget counts merged tokens and a bucket patch rows (vitserve/model/buckets.py): a full batch of a
    16,384-token budget is 65,536 rows (merge_unit 4), and the top bucket is exactly that, so it pads to
    nothing."""
    if shape.visual_batch_max_tokens <= 0:
        buckets = list(DEFAULT_BUCKETS)
    else:
        top = budget_rows(shape.visual_batch_max_tokens, merge_unit)  # whole merge units by construction
        buckets = sorted({b for b in DEFAULT_BUCKETS if b < top} | {top})
    images = shape.visual_infer_batch_size
    ladder = sorted({i for i in DEFAULT_IMAGE_LADDER if i < images} | {images})
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
    patch, merge = int(visual.config.patch_size), int(visual.spatial_merge_size)
    buckets, ladder = serving_buckets(shape, merge * merge)
    runner = TowerRunner(visual, buckets, ladder)
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
    # capture released the allocator's free cached blocks, the reservation's among them (meter.py holds it
    # as such): hold it again on top of the graphs, as a warm start holds a stored one, and let PeakWatch
    # count from here (the warm-ups' peak is gone with their blocks)
    CudaMeter(device).hold(res.bytes)
    torch.cuda.reset_peak_memory_stats(device)
    if watch is not None:
        watch.published += grown
    log.info("--cuda_graphs: %d graphs, buckets %s, %.0f MiB added to the reservation", len(runner.graphs),
             buckets, grown / 2**20)  # fmt: skip
    return dataclasses.replace(res, bytes=res.bytes + grown)
