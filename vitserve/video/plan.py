"""The per-video resize plan: frame size, grid and tokens under the two budgets (docs/processing.md "Video").

A video of ``n`` sampled frames is ``T`` temporal groups (``ceil(n / temporal_patch_size)``; InternVL: one
group per frame). Each group is one item of the queue with grid ``(1, h, w)``, so two limits bound the frame
size ``h x w`` (in merged tokens ``gh x gw``):
- ``--visual_batch_max_tokens`` caps one group: ``gh * gw <= budget`` (frames are clamped as images are);
- ``--max_video_tokens`` caps the video: ``T * gh * gw <= max_video_tokens``, so ``gh * gw <= max // T``.

Both are set inside the video processor the way the image clamp is (vitserve/processors/qwen.py): the group
budget ``b`` becomes transformers' ``size["longest_edge"]``, per frame (``b * factor**2``, Qwen2-VL/2.5-VL)
or over all frames (``b * factor**2 * n``, Qwen3-VL/3.5, whose limit is a total), and transformers' own
resize rule is run with it (``longest_edge`` in the plan). Where that rule still overshoots ``b`` (a side
forced up to one patch group, or a frame grown to ``min_pixels``), the grid is shrunk to fit with the images'
`shrink_grid`, below ``min_pixels`` if need be (an image grown to it is fitted or refused instead:
processors/budget.py), and the plan says ``hf_native=False``. InternVL's tiles cannot shrink: over a limit is a 413 that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from vitserve.errors import AspectRatioTooLarge, ImageTooSmall, OverTokenBudget
from vitserve.families import MAX_ASPECT_RATIO
from vitserve.processors.budget import shrink_grid
from vitserve.video.settings import VideoSettings


@dataclass(frozen=True)
class VideoPlan:
    """What preprocessing a video of ``num_frames`` sampled frames of (width, height) produces."""

    resized_size: tuple[int, int]  # (width, height) of every frame fed to the encoder
    grid_thw: tuple[
        int, int, int
    ]  # (T groups, h patches, w patches); InternVL: (frames, tile/patch, tile/patch)
    group_tokens: int  # merged tokens of one temporal group (one queue item)
    num_tokens: int  # T * group_tokens
    clamped: bool  # a budget changed the frame size from what the unclamped processor gives
    longest_edge: int  # patches: the size["longest_edge"] the clamped transformers processor gets (tiles: 0)
    hf_native: bool  # transformers with that longest_edge produces exactly this size


def plan_video(
    settings: VideoSettings,
    width: int,
    height: int,
    num_frames: int,
    budget_tokens: int,
    max_video_tokens: int,
) -> VideoPlan:
    """The plan for ``num_frames`` sampled frames of width x height; raises the documented errors."""
    if width < 1 or height < 1:
        raise ImageTooSmall(f"video frame size {width}x{height} has an empty side")
    if settings.resize == "tile":
        return _plan_tiles(settings, num_frames, budget_tokens, max_video_tokens)
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise AspectRatioTooLarge(
            f"video frames of {width}x{height} have aspect ratio {max(width, height) / min(width, height):.1f}, "
            f"above the processor's limit of {MAX_ASPECT_RATIO}"
        )
    groups = -(-num_frames // settings.temporal_patch_size)
    budget = _group_budget(groups, budget_tokens, max_video_tokens)
    f = settings.patch_size * settings.merge_size
    native = _hf_resize(settings, num_frames, height, width, settings.max_pixels)
    longest = settings.max_pixels
    if budget > 0:
        per_group = budget * f * f * (num_frames if settings.resize == "total" else 1)
        longest = min(settings.max_pixels, per_group)
    res_h, res_w = _hf_resize(settings, num_frames, height, width, longest)
    gh, gw = res_h // f, res_w // f
    hf_native = True
    if budget > 0 and gh * gw > budget:
        gh, gw = shrink_grid(gh, gw, budget)  # shrunk in every case, grown frames too (processors/budget.py)
        res_h, res_w, hf_native = gh * f, gw * f, False
    m = settings.merge_size
    return VideoPlan(
        resized_size=(res_w, res_h),
        grid_thw=(groups, gh * m, gw * m),
        group_tokens=gh * gw,
        num_tokens=groups * gh * gw,
        clamped=(res_h, res_w) != native,
        longest_edge=longest,
        hf_native=hf_native,
    )


def _group_budget(groups: int, budget_tokens: int, max_video_tokens: int) -> int:
    """The most merged tokens one group may have (0 = no limit)."""
    limits = [budget_tokens] if budget_tokens > 0 else []
    if max_video_tokens > 0:
        if groups > max_video_tokens:
            raise OverTokenBudget(
                f"the video has {groups} temporal groups of at least 1 token each, over --max_video_tokens="
                f"{max_video_tokens}; ask for a lower fps or fewer num_frames"
            )
        limits.append(max_video_tokens // groups)
    return min(limits, default=0)


def _plan_tiles(settings: VideoSettings, frames: int, budget_tokens: int, max_video_tokens: int) -> VideoPlan:
    tokens = settings.tokens_per_tile
    if budget_tokens > 0 and tokens > budget_tokens:
        raise OverTokenBudget(
            f"one video frame (one tile) needs {tokens} image tokens, over --visual_batch_max_tokens={budget_tokens}"
        )
    if max_video_tokens > 0 and frames * tokens > max_video_tokens:
        raise OverTokenBudget(
            f"{frames} frames of {tokens} tokens each need {frames * tokens} tokens, over --max_video_tokens="
            f"{max_video_tokens} (InternVL's tiles cannot shrink); ask for a lower fps or fewer num_frames"
        )
    side = settings.tile // settings.patch_size
    return VideoPlan(
        resized_size=(settings.tile, settings.tile),
        grid_thw=(frames, side, side),
        group_tokens=tokens,
        num_tokens=frames * tokens,
        clamped=False,
        longest_edge=0,
        hf_native=True,
    )


def _hf_resize(
    settings: VideoSettings, frames: int, height: int, width: int, longest_edge: int
) -> tuple[int, int]:
    """(height, width) transformers' video processor resizes to with size["longest_edge"] = longest_edge:
    its ``resize`` method, cap_pixels_per_frame included, for the family's rule."""
    f, shortest = settings.patch_size * settings.merge_size, settings.min_pixels
    tps = settings.temporal_patch_size
    max_pixels = longest_edge
    if settings.resize == "per_frame":  # Qwen2VLVideoProcessor.resize
        if settings.cap_pixels_per_frame:
            total_pixels = int(settings.hf_max_video_tokens * f * f * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * tps // frames), int(shortest * 1.05))
        height_out, width_out = smart_resize(
            height, width, factor=f, min_pixels=shortest, max_pixels=max_pixels
        )
        return int(height_out), int(width_out)
    if settings.cap_pixels_per_frame:  # Qwen3VLVideoProcessor.resize
        frame_cap = settings.hf_max_video_tokens * f * f
        max_pixels = max(min(frame_cap, longest_edge // frames), int(shortest * 1.05)) * frames
    return smart_resize_frames(frames, height, width, tps, f, shortest, max_pixels)


def smart_resize_frames(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize, whose pixel limits bound all frames together (the
    expressions of transformers/models/qwen3_vl/video_processing_qwen3_vl.py, which needs torchvision to
    import). The aspect ratio and the frame count were checked before."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
