"""Token-budget math: the one place that decides an image's resized size, patch grid and token count.

docs/design.md invariant 1: every accepted image has ``num_tokens <= budget``. HF's ``smart_resize`` alone does not
guarantee it even with ``max_pixels`` clamped to ``budget * factor**2``:
- in its shrink branch each side is floored to a multiple of ``factor`` but never below one ``factor``
  (``max(factor, ...)``), so an image whose aspect ratio is above the budget keeps a long side that is
  still too long (28x5000 at a 4-token budget -> 1x26 merged tokens);
- in its grow branch (area below ``min_pixels``) both sides are rounded *up*, so a thin image, or a budget
  close to ``min_pixels``, overshoots (1x100 at min 4 tokens -> 1x20 tokens).

The rule used here: take exactly what the clamped HF processor would produce. When that is over the budget,
the path depends on the branch HF took (`plan_qwen`):
- HF's shrink branch (above the clamped max_pixels, one side forced up to one patch group): `shrink_grid`,
  which keeps that side at one token and cuts the other to the budget (1 x budget);
- HF's grow branch (below ``min_pixels``, enlarged to it with both sides rounded up) and ``budget >=
  min_tokens``: not `shrink_grid` (it could fall below the processor's minimum) but `_fit_grow`, the grid
  with ``min_tokens <= tokens <= budget`` whose aspect ratio is closest to the image's;
- HF's grow branch and ``budget < min_tokens``: no grid fits, and the image is refused with OverTokenBudget
  (413: the processor's minimum is above the budget);
- HF's round branch is never over the budget (its area is within the clamped max_pixels).
Video frames take `shrink_grid` in every over-budget case, a frame grown to ``min_pixels`` included: it is
shrunk, below ``min_pixels`` if need be, where an image would be fitted or refused (video/plan.py).
In HF's shrink branch the result may be below ``min_pixels`` (HF itself does that when
``max_pixels < min_pixels``); vitserve follows HF there.
Aspect ratio above 200 -> AspectRatioTooLarge (HF's own limit). A side that would round to zero (only with
``min_pixels <= 0``) -> ImageTooSmall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from vitserve.errors import AspectRatioTooLarge, ImageTooSmall, OverTokenBudget
from vitserve.families import MAX_ASPECT_RATIO


@dataclass(frozen=True)
class Plan:
    """What preprocessing one image of (width, height) will produce."""

    resized_size: tuple[int, int]  # (width, height) fed to the encoder (InternVL: the tiled canvas)
    grid_thw: tuple[int, int, int]  # Qwen: (1, h_patches, w_patches); InternVL: (num_tiles, h, w) of one tile
    num_tokens: int  # merged tokens
    clamped: bool  # the budget changed the result from what the unclamped processor gives
    hf_native: bool  # the clamped HF object, called as is, produces exactly this size


@dataclass(frozen=True)
class QwenGeometry:
    patch_size: int
    merge_size: int
    min_pixels: int  # HF size["shortest_edge"] as shipped
    max_pixels: int  # HF size["longest_edge"] as shipped

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def min_tokens(self) -> int:
        """Fewest merged tokens the processor grows a small image to (ceil(min_pixels / factor^2))."""
        return max(1, -(-self.min_pixels // (self.factor * self.factor)))

    def clamped_max_pixels(self, budget: int) -> int:
        """The max_pixels to set on the HF object for this budget (0 = no budget)."""
        if budget <= 0:
            return self.max_pixels
        return min(self.max_pixels, budget * self.factor * self.factor)


def over_budget(tokens: int, budget: int, what: str) -> OverTokenBudget:
    return OverTokenBudget(
        f"{what} needs {tokens} image tokens, over the per-image budget of {budget} "
        "set by --visual_batch_max_tokens"
    )


def _check_representable(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ImageTooSmall(f"image size {width}x{height} has an empty side")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioTooLarge(
            f"image {width}x{height} has aspect ratio {max(height, width) / min(height, width):.1f}, above "
            f"the processor's limit of {MAX_ASPECT_RATIO} (a property of the model, not a flag)"
        )


def _hf_branch(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> str:
    """Which branch HF's smart_resize takes (same expressions as HF)."""
    rounded = round(height / factor) * factor * (round(width / factor) * factor)
    if rounded > max_pixels:
        return "shrink"
    return "grow" if rounded < min_pixels else "round"


def shrink_grid(gh: int, gw: int, budget: int) -> tuple[int, int]:
    """The shrink-to-budget rule: the merged-token grid scaled down to at most ``budget`` tokens, the aspect
    ratio kept as far as whole tokens allow (each side at least 1).

    Images reach it only from HF's shrink branch, with one side forced up to a single patch group; there it
    keeps that side and caps the other at the budget (1 x budget). A small image HF grew to min_pixels that
    is still over the budget does not come here: `plan_qwen` fits it with `_fit_grow`, or refuses it. Video
    frames reach it whenever a group's grid is over its budget (video/plan.py), grown frames included: when
    --max_video_tokens leaves a group fewer tokens than transformers' video processor gives (which knows no
    such limit), or when Qwen3-VL's rule bounds all frames together and rounds their count up; both sides
    shrink then. Where an image and a frame of one size still get different grids, it is because of this,
    or because transformers' image and video processors do (their own min/max pixels, Qwen3-VL's all-frames
    bound): video/plan.py."""
    if gh * gw <= budget:
        return gh, gw
    scale = math.sqrt(budget / (gh * gw))
    gh, gw = max(1, math.floor(gh * scale)), max(1, math.floor(gw * scale))
    while gh * gw > budget:  # floor() can still leave one token too many, and a side held at 1 does
        if gh >= gw:
            gh -= 1
        else:
            gw -= 1
    return gh, gw


def _fit_grow(width: int, height: int, budget: int, min_tokens: int) -> tuple[int, int]:
    """Grow branch: the grid with min_tokens <= gh * gw <= budget whose aspect ratio is closest to the
    image's (ratio distance max(r/t, t/r), compared exactly in integers), then the most tokens, then the
    fewest rows. Exists whenever budget >= min_tokens (1 x budget always qualifies)."""
    if budget < min_tokens:
        raise ValueError("no grid between min_tokens and budget")
    best: tuple[int, int, int, int] | None = None  # (error numerator, error denominator, gh, gw)
    for gh in range(1, budget + 1):
        lo, hi = max(1, -(-min_tokens // gh)), budget // gh
        if lo > hi:
            continue
        ideal = gh * width // height  # the best gw is the floor or the ceil of gh * width / height
        for gw in (min(max(ideal, lo), hi), min(max(ideal + 1, lo), hi)):
            # gw/gh vs width/height: error = max(gw*height, width*gh) / min(...) >= 1
            num, den = max(gw * height, width * gh), min(gw * height, width * gh)
            if best is None or _better(num, den, gh * gw, best):
                best = (num, den, gh, gw)
    assert best is not None  # gh = 1, gw = budget qualifies
    return best[2], best[3]


def _better(num: int, den: int, tokens: int, best: tuple[int, int, int, int]) -> bool:
    lhs, rhs = num * best[1], best[0] * den  # num/den vs best error, without floats
    return lhs < rhs or (lhs == rhs and tokens > best[2] * best[3])


def plan_qwen(width: int, height: int, geo: QwenGeometry, budget: int) -> Plan:
    """Resized size, grid and tokens for a Qwen-family image; raises the documented errors."""
    _check_representable(width, height)
    f = geo.factor
    native_h, native_w = smart_resize(height, width, f, geo.min_pixels, geo.max_pixels)
    clamp_max = geo.clamped_max_pixels(budget)
    hf_h, hf_w = smart_resize(height, width, f, geo.min_pixels, clamp_max)
    if hf_h < f or hf_w < f:
        raise ImageTooSmall(
            f"image {width}x{height} resizes to {hf_w}x{hf_h}, below one {f}-pixel patch group "
            "(the processor's min_pixels is not positive)"
        )
    gh, gw = hf_h // f, hf_w // f  # merged-token grid
    hf_native = True
    if budget > 0 and gh * gw > budget:
        hf_native = False
        if _hf_branch(height, width, f, geo.min_pixels, clamp_max) != "grow":
            gh, gw = shrink_grid(gh, gw, budget)
        elif budget >= geo.min_tokens:
            gh, gw = _fit_grow(width, height, budget, geo.min_tokens)
        else:
            raise over_budget(
                geo.min_tokens,
                budget,
                f"image {width}x{height} is grown by the processor to its min_pixels={geo.min_pixels}, which",
            )
    res_h, res_w = gh * f, gw * f
    m = geo.merge_size
    return Plan(
        resized_size=(res_w, res_h),
        grid_thw=(1, gh * m, gw * m),
        num_tokens=gh * gw,
        clamped=(res_h, res_w) != (native_h, native_w),
        hf_native=hf_native,
    )


@dataclass(frozen=True)
class TileGeometry:
    tile_height: int
    tile_width: int
    patch_size: int
    tokens_per_tile: int  # vitserve.families.tokens_per_tile: 256 for InternVL at 448/14/0.5
    min_patches: int  # as shipped
    max_patches: int  # as shipped

    def clamped_max_patches(self, budget: int) -> int:
        """max_patches so that the worst case (max tiles + the thumbnail) fits the budget."""
        if budget <= 0:
            return self.max_patches
        tiles = budget // self.tokens_per_tile
        # max_patches p > 1 can give p tiles plus a thumbnail; p == 1 gives one tile, no thumbnail
        return min(self.max_patches, max(1, tiles - 1))


def tile_canvas(
    width: int, height: int, geo: TileGeometry, min_patches: int, max_patches: int
) -> tuple[int, int, int]:
    """(columns, rows, tiles) of HF's GotOcr2 crop_to_patches; tiles counts the thumbnail, same rules as HF."""
    if max_patches <= 1:
        return 1, 1, 1
    cols, rows = get_optimal_tiled_canvas(
        (height, width), (geo.tile_height, geo.tile_width), min_patches, max_patches
    )
    return cols, rows, (cols * rows + 1 if cols * rows > 1 else 1)


def plan_tiles(width: int, height: int, geo: TileGeometry, budget: int) -> Plan:
    """Tiles and tokens for an InternVL image (dynamic tiling, crop_to_patches=True)."""
    if width < 1 or height < 1:
        raise ImageTooSmall(f"image size {width}x{height} has an empty side")
    if budget > 0 and geo.tokens_per_tile > budget:
        raise over_budget(geo.tokens_per_tile, budget, "one tile of this model")
    max_p = geo.clamped_max_patches(budget)
    min_p = min(geo.min_patches, max_p)
    cols, rows, tiles = tile_canvas(width, height, geo, min_p, max_p)
    native = tile_canvas(width, height, geo, geo.min_patches, geo.max_patches)[2]
    ph, pw = geo.tile_height // geo.patch_size, geo.tile_width // geo.patch_size
    return Plan(
        resized_size=(cols * geo.tile_width, rows * geo.tile_height),  # the canvas the tiles are cut from
        grid_thw=(tiles, ph, pw),
        num_tokens=tiles * geo.tokens_per_tile,
        clamped=tiles != native,
        hf_native=True,
    )
