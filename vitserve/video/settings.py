"""The video processor settings of a checkpoint, read offline the way transformers finds them.

Where transformers looks (AutoVideoProcessor.from_pretrained): the ``video_processor`` section of
``processor_config.json``, else ``video_preprocessor_config.json``. Without either, transformers borrows the
image processor's ``preprocessor_config.json`` and builds Qwen2-VL's video class whatever the model is; vitserve
instead takes the family's own video class defaults (vitserve/families.py) for the pixel and frame limits and
the image processor's normalisation and patch geometry, and says so in the log (docs/processing.md "Video").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vitserve.checkpoint import Checkpoint
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, VIDEO_DEFAULT_FPS
from vitserve.processors import VisionProcessor
from vitserve.processors.hf_config import BICUBIC  # the filter every family's video processor resizes with
from vitserve.video.sampling import SamplingRules

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoSettings:
    """One family's video processor, resolved. The attribute names of the normalisation are transformers' own,
    so vitserve.processors.pixels.torch_value_table reads them from this object as from an HF processor."""

    family: str
    sampling: SamplingRules
    resize: str  # "per_frame" | "total" | "tile" (Family.video_resize)
    time: str  # "none" | "second_per_grid" | "timestamps" (Family.video_time)
    patch_size: int
    merge_size: int  # patches: 2x2 patches per token; tiles: 1
    temporal_patch_size: int  # frames per temporal group (tiles: 1)
    min_pixels: int  # patches: size["shortest_edge"]
    max_pixels: int  # patches: size["longest_edge"] as shipped (before the budget clamp)
    tile: int  # tiles: the side every frame is resized to
    tokens_per_tile: int  # tiles
    cap_pixels_per_frame: (
        bool  # transformers' qwen-vl-utils cap; unset = False, transformers' current default
    )
    hf_max_video_tokens: int  # transformers' own max_video_tokens, read only by cap_pixels_per_frame
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    source: str  # where the settings came from, for the log and clamp_info


# transformers' class defaults of max_video_tokens (only used with cap_pixels_per_frame)
_HF_MAX_VIDEO_TOKENS = {"qwen2": 128000, "qwen3": 768}


def video_settings(family: str, checkpoint: Checkpoint | None, image_proc: VisionProcessor) -> VideoSettings:
    """The settings of ``family``'s video processor for ``checkpoint`` (None: the registry's defaults).

    ``image_proc``: the family's image processor (its normalisation and patch geometry apply where the video
    config is silent; for tiles, its tile and tokens per tile).
    """
    config, source = _video_config(checkpoint)
    fam = FAMILIES[family]
    image_hf = image_proc.hf
    tile, tile_tokens = 0, 0
    if fam.layout == "tiles":
        geometry = image_proc.geometry  # type: ignore[attr-defined]  # InternVLProcessor's TileGeometry
        patch, merge, temporal = int(geometry.patch_size), 1, 1
        tile, tile_tokens = _tile(config, image_hf), int(geometry.tokens_per_tile)
    else:
        patch = int(config.get("patch_size", image_hf.patch_size))
        merge = int(config.get("merge_size", image_hf.merge_size))
        temporal = int(config.get("temporal_patch_size", image_hf.temporal_patch_size))
        image_grid = (int(image_hf.patch_size), int(image_hf.merge_size), int(image_hf.temporal_patch_size))
        if (patch, merge, temporal) != image_grid:  # the image grid was checked against the tower's
            raise ConfigError(
                f"{source}: patch_size, merge_size, temporal_patch_size {(patch, merge, temporal)} differ from the "
                f"image processor's {image_grid}, which match the vision tower; fix the checkpoint (--model)"
            )
    _check_supported(config, family, source)
    min_pixels, max_pixels = _pixel_limits(
        config, fam.video_sampler, fam.video_min_pixels, fam.video_max_pixels
    )
    fps = config.get("fps")
    sampling = SamplingRules(
        sampler=fam.video_sampler,
        temporal_patch_size=temporal,
        min_frames=int(config.get("min_frames", fam.video_min_frames)),
        max_frames=int(config.get("max_frames", fam.video_max_frames)),
        default_fps=float(fps if fps is not None else (fam.video_fps or VIDEO_DEFAULT_FPS)),
        initial_shift=config.get("initial_shift", True),
    )
    return VideoSettings(
        family=family,
        sampling=sampling,
        resize=fam.video_resize,
        time=fam.video_time,
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        tile=tile,
        tokens_per_tile=tile_tokens,
        cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
        hf_max_video_tokens=int(
            config.get("max_video_tokens", _HF_MAX_VIDEO_TOKENS.get(fam.video_sampler, 0))
        ),
        do_rescale=bool(config.get("do_rescale", image_hf.do_rescale)),
        rescale_factor=float(config.get("rescale_factor", image_hf.rescale_factor)),
        do_normalize=bool(config.get("do_normalize", image_hf.do_normalize)),
        image_mean=tuple(config.get("image_mean", image_hf.image_mean)),
        image_std=tuple(config.get("image_std", image_hf.image_std)),
        source=source,
    )


def _video_config(checkpoint: Checkpoint | None) -> tuple[dict[str, Any], str]:
    if checkpoint is None or checkpoint.path is None:
        return {}, "the family's defaults"
    if checkpoint.video_processor_config is not None:
        return dict(checkpoint.video_processor_config), f"{checkpoint.name}'s video processor config"
    log.warning(
        "%s has no video processor config: videos use the family's transformers class defaults for pixel and "
        "frame limits, not the image limits transformers' AutoVideoProcessor would borrow",
        checkpoint.name,
    )
    return {}, "the family's defaults (no video processor config)"


def _check_supported(config: dict[str, Any], family: str, source: str) -> None:
    """Settings the torch pixel path does not reproduce are refused at start-up, naming the file."""
    if config.get("do_resize") is False or int(config.get("resample", BICUBIC)) != BICUBIC:
        raise ConfigError(
            f"{source}: vitserve resizes video frames bicubic, as {family}'s video processor ships; this "
            f"checkpoint asks for do_resize={config.get('do_resize')}, resample={config.get('resample')}"
        )
    if config.get("do_center_crop"):
        raise ConfigError(f"{source}: do_center_crop is not supported for {family} videos")


def _pixel_limits(
    config: dict[str, Any], sampler: str, min_default: int, max_default: int
) -> tuple[int, int]:
    """size["shortest_edge"], size["longest_edge"]; Qwen2-VL's class also takes min_pixels/max_pixels keys,
    which win over size (its __init__); the other classes ignore them."""
    size = config.get("size") or {}
    low = int(size.get("shortest_edge", min_default))
    high = int(size.get("longest_edge", max_default))
    if sampler == "qwen2":
        low = int(config.get("min_pixels") or low)
        high = int(config.get("max_pixels") or high)
    return low, high


def _tile(config: dict[str, Any], image_hf: Any) -> int:
    """InternVL: every frame becomes one tile of the video config's size (the image processor's tile when the
    config is silent), which must be square and the tower's tile."""
    image_tile = int(image_hf.size["height"])
    size = config.get("size") or {"height": image_tile, "width": image_tile}
    height, width = int(size.get("height", 0)), int(size.get("width", 0))
    if height != width or height != image_tile:
        raise ConfigError(
            f"InternVL video frames of {width}x{height} do not match the tower's {image_tile}x{image_tile} tile; "
            "fix size in the checkpoint's video processor config"
        )
    return height
