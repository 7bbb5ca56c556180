"""Building the HF image processor object of a family: from the checkpoint offline, or from the registry's
public defaults (vitserve/families.py) with the patch geometry of the checkpoint's config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil

from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, Family, family_of_model_type, tokens_per_tile

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, what InternVL's published processors use


def defaults(family: Family) -> dict[str, Any]:
    """The HF processor parameters of a family's published checkpoints."""
    common = {"image_mean": list(family.image_mean), "image_std": list(family.image_std)}
    if family.layout == "tiles":
        side = family.tile_size
        return {
            "size": {"height": side, "width": side},
            "min_patches": family.min_tiles,
            "max_patches": family.max_tiles,
            "resample": _BICUBIC,
            **common,
        }
    return {
        "size": {"shortest_edge": family.min_pixels, "longest_edge": family.max_pixels},
        "patch_size": family.patch_size,
        "temporal_patch_size": family.temporal_patch_size,
        "merge_size": family.merge_size,
        **common,
    }


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a file, None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; fix the checkpoint given by --model") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; fix the checkpoint given by --model")
    return data


def family_of_checkpoint(path: str | Path, family: str = "auto") -> str:
    """The vitserve family of a checkpoint (``model_type`` in its config.json) and a --model_family value."""
    config = read_json(Path(path) / "config.json")
    if config is None:
        if family != "auto":
            return family_of_model_type("", family).name
        raise ConfigError(
            f"{path} has no config.json; pass a checkpoint directory to --model or set --model_family"
        )
    try:
        return family_of_model_type(str(config.get("model_type", "")), family).name
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({path}/config.json)") from None


def _vision_config(config: dict[str, Any] | None) -> dict[str, Any]:
    vision = (config or {}).get("vision_config") or {}
    return vision if isinstance(vision, dict) else {}


def _first(value: Any) -> int:
    """HF configs store sizes as an int or an [h, w] pair."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def has_image_processor_config(checkpoint: Path | None) -> bool:
    """preprocessor_config.json, or (newer checkpoints) processor_config.json with an "image_processor"
    section: both are what HF's from_pretrained reads."""
    if checkpoint is None:
        return False
    if (checkpoint / "preprocessor_config.json").is_file():
        return True
    combined = read_json(checkpoint / "processor_config.json")
    return isinstance((combined or {}).get("image_processor"), dict)


def tower_geometry(checkpoint: Path | None) -> dict[str, int]:
    """What the checkpoint's vision tower (config.json) says about the patch grid, for check_geometry."""
    vision = _vision_config(read_json(checkpoint / "config.json") if checkpoint else None)
    keys = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"))
    return {key: _first(vision[src]) for key, src in keys if src in vision}


def qwen_hf_processor(family: str, checkpoint: Path | None) -> Qwen2VLImageProcessorPil:
    """The checkpoint's preprocessor_config.json, or the family's public defaults with the patch geometry
    of its config.json."""
    if has_image_processor_config(checkpoint):
        return Qwen2VLImageProcessorPil.from_pretrained(str(checkpoint), local_files_only=True)
    params = defaults(FAMILIES[family])
    vision = _vision_config(read_json(checkpoint / "config.json") if checkpoint else None)
    for key, src in (
        ("patch_size", "patch_size"),
        ("merge_size", "spatial_merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
    ):
        if src in vision:
            params[key] = int(vision[src])
    processor: Qwen2VLImageProcessorPil = Qwen2VLImageProcessorPil.from_dict(params)
    return processor


def internvl_hf_processor(family: str, checkpoint: Path | None) -> tuple[GotOcr2ImageProcessorPil, int, int]:
    """(HF processor, vision patch size, tokens per tile) for a tiles-layout (InternVL) checkpoint or the
    registry defaults.

    Without a processor config the tile is the tower's image_size, else the registry's.
    """
    config = read_json(checkpoint / "config.json") if checkpoint else None
    config = config or {}
    vision = _vision_config(config)
    registry = FAMILIES[family]
    patch = _first(vision.get("patch_size", registry.patch_size))
    ratio = float(config.get("downsample_ratio", registry.downsample_ratio))
    if has_image_processor_config(checkpoint):
        hf = GotOcr2ImageProcessorPil.from_pretrained(str(checkpoint), local_files_only=True)
    else:
        params = defaults(registry)
        tile = vision.get("image_size")
        if tile:
            params["size"] = {"height": _first(tile), "width": _first(tile)}
        hf = GotOcr2ImageProcessorPil.from_dict(params)
    tile_h, tile_w = int(hf.size["height"]), int(hf.size["width"])
    if tile_h != tile_w:
        raise ConfigError(
            f"InternVL tile {tile_w}x{tile_h} is not square; fix the checkpoint given by --model"
        )
    return hf, patch, tokens_per_tile(tile_h, patch, ratio)
