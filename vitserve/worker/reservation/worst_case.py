"""The worst-case batch under the token budget, and the other full-budget batches the start-up stress runs.

Which batch is the worst case:
- Qwen families: ONE image with the most tokens <= budget. Linear layers, norms and the merger cost memory
  linear in the total patch count, which is the same for one big image or many small ones at the same
  total; attention is per image (cu_seqlens), and every implementation costs at least as much for one
  image of n patches as for k images of n/k (eager/SDPA-math scores are O(n^2) per image; padded-batch
  kernels k*(n/k)^2; flash kernels are linear). Qwen2.5-VL runs window attention in most blocks (windows
  of `window_size` pixels, linear in n) but FULL attention over each whole image in
  `fullatt_block_indexes` — which is O(n^2) per image, so one big image is the worst case there as well.
  The grid is near-square with both sides multiples of `spatial_merge_size` (the processor's output shape).
  Measured with the production encoder, fast kernels and HF's eager attention alike (bench/RESULTS.md,
  "The worst-case batch").
  Caveat on CPU: glibc's heap fragments, so a later batch (even the same one) can raise the RSS peak above
  the stress peak (docs/design.md invariant 7, tests/integration/test_memory_full_budget.py); hence the
  multi-batch stress and meter.HEAP_FACTOR. CUDA's caching allocator reuses its blocks.
- InternVL: every tile is encoded independently at the fixed tile size, so memory grows with the total
  number of tiles in the batch: as many tiles as the budget admits. The per-image tile cap is the
  processor's (clamped `max_patches` + the thumbnail) and is not known to the encoder; when the caller
  passes it (`max_tiles_per_image`), the tiles are split into images of at most that many, at most
  `max_batch_images` images; without it the budget alone bounds the batch (one image holding every tile —
  the same memory as several images, and never less than a real batch).
- Budget 0 (no vitserve clamp): each image is bounded only by the processor's own maximum
  (`max_image_tokens`: Qwen max_pixels / (patch x merge)^2, 16,384 tokens for the published defaults;
  InternVL max_patches tiles + the thumbnail) and a batch by `max_batch_images` images, so the worst case is
  `max_batch_images` images of that maximum (docs/api.md). Without `max_image_tokens` (an encoder used
  outside a configured rank) we fall back to one image of `DISABLED_BUDGET_TOKENS` and say so.

"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vitserve.checkpoint import first_size
from vitserve.contract import ProcessedImage
from vitserve.errors import ConfigError
from vitserve.families import DISABLED_BUDGET_TOKENS, FAMILIES, MAX_ASPECT_RATIO, tokens_per_tile
from vitserve.model.base import Encoder

log = logging.getLogger(__name__)


def worst_case_items(
    encoder: Encoder,
    budget_tokens: int,
    max_batch_images: int,
    *,
    max_tiles_per_image: int | None = None,
    max_image_tokens: int | None = None,
) -> list[ProcessedImage]:
    """The synthetic batch that maximises activation memory under the budget and the batch-size cap.

    max_tiles_per_image: InternVL only, the processor's per-image tile limit (max_patches + 1), if known.
    max_image_tokens: the processor's largest image in tokens; used when the budget is 0 (see above).
    """
    plan = _worst_case_plan(encoder, budget_tokens, max_batch_images, max_tiles_per_image, max_image_tokens)
    if isinstance(plan, _Tiles):
        return _internvl_items(plan)
    cfg = _vision_config(encoder)
    made: dict[tuple[int, int], ProcessedImage] = {}  # equal images share one pixel tensor
    for grid in plan:
        if grid not in made:
            made[grid] = qwen_item(cfg, grid)
    return [made[grid] for grid in plan]


def worst_case_units(
    encoder: Encoder,
    budget_tokens: int,
    max_batch_images: int,
    *,
    max_tiles_per_image: int | None = None,
    max_image_tokens: int | None = None,
) -> tuple[list[int], int]:
    """(attention_units, images) of the worst case, without building its pixels."""
    plan = _worst_case_plan(encoder, budget_tokens, max_batch_images, max_tiles_per_image, max_image_tokens)
    if isinstance(plan, _Tiles):
        return [plan.per_tile] * sum(plan.per_image), len(plan.per_image)
    return [rows * cols for rows, cols in plan], len(plan)


def attention_units(encoder: Encoder, items: list[ProcessedImage]) -> list[int]:
    """Tokens of each segment that attention runs over as a whole, for the memory model's quadratic term:
    each image (Qwen families; windows are smaller), each tile (InternVL)."""
    if getattr(FAMILIES.get(encoder.family), "layout", None) == "tiles":
        return [it.num_tokens // it.grid_thw[0] for it in items for _ in range(it.grid_thw[0])]
    return [it.num_tokens for it in items]


@dataclass(frozen=True)
class _Tiles:
    """An InternVL worst case: tiles per image, and the tile geometry."""

    per_image: list[int]
    per_tile: int  # tokens
    image_size: int  # pixels per tile side
    side: int  # patches per tile side
    channels: int


def _worst_case_plan(
    encoder: Encoder,
    budget_tokens: int,
    max_batch_images: int,
    max_tiles_per_image: int | None,
    max_image_tokens: int | None,
) -> list[tuple[int, int]] | _Tiles:
    """Qwen: the (rows, cols) merged-token grid of each image; InternVL: _Tiles."""
    if max_batch_images < 1:
        raise ConfigError(f"--visual_infer_batch_size must be >= 1, got {max_batch_images}")
    layout = getattr(FAMILIES.get(encoder.family), "layout", None)  # None: a family with no worst case
    if budget_tokens <= 0 and max_image_tokens:
        if layout == "patches":  # budget 0: the batch-size cap bounds a batch of the processor's largest
            return [near_square_grid(max_image_tokens)] * max_batch_images
        budget_tokens = max_batch_images * max_image_tokens
    if budget_tokens <= 0:
        log.warning(
            "--visual_batch_max_tokens 0 without the processor's image limit: stressing a default of %d "
            "tokens. Set --visual_reserved_mem_gb to reserve for larger batches.",
            DISABLED_BUDGET_TOKENS,
        )
        budget_tokens = DISABLED_BUDGET_TOKENS
    if layout == "patches":
        return [near_square_grid(budget_tokens)]
    if layout == "tiles":
        return _internvl_plan(encoder, budget_tokens, max_batch_images, max_tiles_per_image)
    raise ConfigError(
        f"no worst-case shape for family {encoder.family!r}; set --visual_reserved_mem_gb to skip the stress"
    )


def stress_batches(
    encoder: Encoder,
    budget_tokens: int,
    max_batch_images: int,
    *,
    max_tiles_per_image: int | None = None,
    max_image_tokens: int | None = None,
) -> Iterator[list[ProcessedImage]]:
    """The batches the start-up stress runs, one at a time: the worst case, other full-budget compositions,
    then the worst case again.

    One run of the worst case measures its activations on a clean heap, but on CPU the heap that runtime
    batches of other shapes leave behind is fragmented, and a later worst case then needs fresh pages on top
    (bench/RESULTS.md, "The worst-case batch"). Every
    batch here is one the scheduler can form at this budget, run through the same production forward, so the
    peak covers that fragmentation without allocating anything production would not.
    """
    bounds = {"max_tiles_per_image": max_tiles_per_image, "max_image_tokens": max_image_tokens}
    yield worst_case_items(encoder, budget_tokens, max_batch_images, **bounds)
    if budget_tokens > 0 and getattr(FAMILIES.get(encoder.family), "layout", None) == "patches":
        cfg = _vision_config(encoder)
        for grids in _full_budget_grids(budget_tokens, max_batch_images):
            yield [qwen_item(cfg, grid) for grid in grids]
    yield worst_case_items(encoder, budget_tokens, max_batch_images, **bounds)


def stress_batch_count(encoder: Encoder, budget_tokens: int, max_batch_images: int) -> int:
    """How many batches stress_batches yields, without building them."""
    if budget_tokens > 0 and getattr(FAMILIES.get(encoder.family), "layout", None) == "patches":
        return 2 + len(_full_budget_grids(budget_tokens, max_batch_images))
    return 2


def _full_budget_grids(budget: int, max_images: int) -> list[list[tuple[int, int]]]:
    """(rows, cols) token grids of batches that fill the budget: one long thin image, max_images equal images,
    and a mix of halving sizes (1/2, 1/4, ...) up to max_images images."""
    rows = max(1, math.isqrt(budget) // 8)
    batches = [[(rows, budget // rows)]]
    equal = budget // max_images
    if max_images > 1 and equal >= 1:
        batches.append([near_square_grid(equal)] * max_images)
    sizes: list[int] = []
    left = budget
    while len(sizes) < max_images - 1 and left // 2 >= 1:
        sizes.append(left // 2)
        left -= left // 2
    if len(sizes) > 1:
        batches.append([near_square_grid(n) for n in [*sizes, left]])
    return batches


def near_square_grid(max_cells: int) -> tuple[int, int]:
    """(rows, cols), rows <= cols, with rows * cols <= max_cells maximal among grids a processor can emit
    (aspect ratio <= MAX_ASPECT_RATIO); among equals the most square one."""
    best = (1, 1)
    for rows in range(math.isqrt(max_cells), 0, -1):
        cols = max_cells // rows
        if cols > MAX_ASPECT_RATIO * rows:
            break  # fewer rows only gets longer and thinner
        if rows * cols > best[0] * best[1]:
            best = (rows, cols)
        if rows * cols == max_cells:
            break
    return best


def qwen_item(cfg: Any, grid: tuple[int, int], seed: int = 0) -> ProcessedImage:
    """What a Qwen image processor hands the engine for an image of `grid` (rows, cols) merged tokens under the
    vision config `cfg`: seeded random patches, (h*w, C*T*P*P). The stress batches' items; tests build theirs
    with it too."""
    merge = int(cfg.spatial_merge_size)
    patch = first_size(cfg.patch_size)
    temporal = first_size(getattr(cfg, "temporal_patch_size", 2))
    channels = int(getattr(cfg, "in_channels", None) or getattr(cfg, "in_chans", None) or 3)
    rows, cols = grid  # merged tokens
    h, w = rows * merge, cols * merge  # patches; multiples of merge_size like the processor's output
    gen = torch.Generator().manual_seed(seed)  # same pixels on every TP rank
    pixels = torch.randn(h * w, channels * temporal * patch * patch, generator=gen)  # (h*w, C*T*P*P)
    return ProcessedImage(
        pixel_values=pixels,
        grid_thw=(1, h, w),
        num_tokens=rows * cols,
        resized_size=(w * patch, h * patch),
        clamped=False,
    )


def _internvl_plan(
    encoder: Encoder, budget_tokens: int, max_batch_images: int, max_tiles_per_image: int | None
) -> _Tiles:
    cfg = _vision_config(encoder)
    image_size = first_size(cfg.image_size)
    patch = first_size(cfg.patch_size)
    ratio = float(_find_attr(encoder, "downsample_ratio", 0.5))
    per_tile = tokens_per_tile(image_size, patch, ratio)
    if per_tile > budget_tokens:
        raise ConfigError(
            f"one InternVL tile is {per_tile} tokens, above --visual_batch_max_tokens {budget_tokens}"
        )
    tiles = budget_tokens // per_tile
    per_image = max(1, max_tiles_per_image) if max_tiles_per_image else tiles
    tiles = min(tiles, max_batch_images * per_image)
    counts = [per_image] * (tiles // per_image) + ([tiles % per_image] if tiles % per_image else [])
    channels = int(getattr(cfg, "num_channels", 3))
    return _Tiles(counts, per_tile, image_size, image_size // patch, channels)


def _internvl_items(plan: _Tiles) -> list[ProcessedImage]:
    gen = torch.Generator().manual_seed(0)  # same pixels on every TP rank
    size = plan.image_size
    return [
        ProcessedImage(
            pixel_values=torch.randn(n, plan.channels, size, size, generator=gen),  # (tiles, C, H, W)
            grid_thw=(n, plan.side, plan.side),
            num_tokens=n * plan.per_tile,
            resized_size=(size, size),
            clamped=False,
        )
        for n in plan.per_image
    ]


def _vision_config(encoder: Encoder) -> Any:
    """The tower's vision config: visual.config (Qwen towers), or visual.vision_tower.config (InternVL)."""
    visual = encoder.visual
    tower = getattr(visual, "vision_tower", None)
    cfg = getattr(visual, "config", None) or getattr(tower, "config", None)
    if cfg is None:
        raise ConfigError(
            "the encoder's visual module has no config; set --visual_reserved_mem_gb to skip the stress"
        )
    return getattr(cfg, "vision_config", None) or cfg


def _find_attr(encoder: Encoder, name: str, default: Any) -> Any:
    """InternVL keeps downsample_ratio on the full-model config; look where a loader may have put it."""
    visual = encoder.visual
    cfg = getattr(visual, "config", None)
    for holder in (encoder, visual, cfg, getattr(cfg, "vision_config", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if value is not None:
            return value
    return default
