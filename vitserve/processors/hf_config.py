"""Building the HF image processor object of a family: from the checkpoint's processor config, or from the
registry's public defaults (vitserve/families.py) with the patch geometry of the checkpoint's config.json
(both read once, by vitserve/checkpoint.py)."""

from __future__ import annotations

import copy
from typing import Any

from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil

from vitserve.checkpoint import Checkpoint, first_size
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, Family, tokens_per_tile

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: InternVL's published processors, every family's video processor


def defaults(family: Family) -> dict[str, Any]:
    """The HF processor parameters of a family's published checkpoints."""
    common = {"image_mean": list(family.image_mean), "image_std": list(family.image_std)}
    if family.layout == "tiles":
        side = family.tile_size
        return {
            "size": {"height": side, "width": side},
            "min_patches": family.min_tiles,
            "max_patches": family.max_tiles,
            "resample": BICUBIC,
            **common,
        }
    return {
        "size": {"shortest_edge": family.min_pixels, "longest_edge": family.max_pixels},
        "patch_size": family.patch_size,
        "temporal_patch_size": family.temporal_patch_size,
        "merge_size": family.merge_size,
        **common,
    }


def qwen_hf_processor(family: str, checkpoint: Checkpoint | None) -> Qwen2VLImageProcessorPil:
    """The checkpoint's image processor config, or the family's public defaults with the patch geometry
    its config.json states."""
    if checkpoint is not None and checkpoint.processor_config is not None:
        # what from_pretrained does after reading the file (transformers' ImageProcessingMixin)
        loaded: Qwen2VLImageProcessorPil = Qwen2VLImageProcessorPil.from_dict(
            copy.deepcopy(dict(checkpoint.processor_config))
        )
        return loaded
    params = defaults(FAMILIES[family])
    vision = checkpoint.vision if checkpoint is not None else {}
    for key, src in (
        ("patch_size", "patch_size"),
        ("merge_size", "spatial_merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
    ):
        if src in vision:
            params[key] = int(vision[src])
    processor: Qwen2VLImageProcessorPil = Qwen2VLImageProcessorPil.from_dict(params)
    return processor


def internvl_hf_processor(
    family: str, checkpoint: Checkpoint | None
) -> tuple[GotOcr2ImageProcessorPil, int, int]:
    """(HF processor, vision patch size, tokens per tile) for a tiles-layout (InternVL) checkpoint or the
    registry defaults.

    Without a processor config the tile is the tower's image_size, else the registry's.
    """
    registry = FAMILIES[family]
    if checkpoint is None:
        patch, ratio = registry.patch_size, registry.downsample_ratio
    else:
        patch, ratio = checkpoint.geometry.patch_size, checkpoint.geometry.downsample_ratio
    if checkpoint is not None and checkpoint.processor_config is not None:
        hf = GotOcr2ImageProcessorPil.from_dict(copy.deepcopy(dict(checkpoint.processor_config)))
    else:
        params = defaults(registry)
        tile = checkpoint.vision.get("image_size") if checkpoint is not None else None
        if tile:
            params["size"] = {"height": first_size(tile), "width": first_size(tile)}
        hf = GotOcr2ImageProcessorPil.from_dict(params)
    tile_h, tile_w = int(hf.size["height"]), int(hf.size["width"])
    if tile_h != tile_w:
        raise ConfigError(
            f"InternVL tile {tile_w}x{tile_h} is not square; fix the checkpoint given by --model"
        )
    return hf, patch, tokens_per_tile(tile_h, patch, ratio)
