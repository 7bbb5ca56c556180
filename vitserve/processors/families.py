"""Model families: which HF image processor, its public defaults, and reading a checkpoint offline.

Public defaults are those of the published checkpoints' preprocessor_config.json (the HF class defaults
differ, e.g. Qwen2VLImageProcessor's own max_pixels is 28*28*1280, while every released Qwen2/2.5-VL
checkpoint ships 12845056 = 28*28*16384; transformers does not carry Qwen3-VL's image defaults at all):
- Qwen2-VL / Qwen2.5-VL: patch 14, merge 2, temporal 2, min_pixels 3136 (4 tokens), max_pixels 12845056
  (16384 tokens), CLIP mean/std.
- Qwen3-VL / Qwen3.5: patch 16, merge 2 (factor 32), temporal 2, size shortest_edge 65536 (64 tokens) /
  longest_edge 16777216 (16384 tokens), mean/std 0.5.
- InternVL (HF "internvl" layout): GotOcr2 processor, tile 448, min_patches 1, max_patches 12, ImageNet
  mean/std, bicubic; vision patch 14, downsample_ratio 0.5 -> 256 tokens per tile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil

from vitserve.errors import ConfigError

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
FAMILIES = (*QWEN_FAMILIES, "internvl")

FAMILY_OF_MODEL_TYPE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "internvl": "internvl",
    "internvl_chat": "internvl",
}

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_QWEN2_DEFAULTS: dict[str, Any] = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": _CLIP_MEAN,
    "image_std": _CLIP_STD,
}
_QWEN3_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
_INTERNVL_DEFAULTS: dict[str, Any] = {
    "size": {"height": 448, "width": 448},
    "min_patches": 1,
    "max_patches": 12,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "resample": 3,  # bicubic
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": _QWEN2_DEFAULTS,
    "qwen2_5_vl": _QWEN2_DEFAULTS,
    "qwen3_vl": _QWEN3_DEFAULTS,
    "qwen3_5": _QWEN3_DEFAULTS,
    "internvl": _INTERNVL_DEFAULTS,
}
INTERNVL_PATCH_SIZE = 14
INTERNVL_DOWNSAMPLE_RATIO = 0.5


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


def family_of_checkpoint(path: str | Path) -> str:
    """The vitserve family of a checkpoint, from ``model_type`` in its config.json."""
    config = read_json(Path(path) / "config.json")
    if config is None:
        raise ConfigError(
            f"{path} has no config.json; pass a checkpoint directory to --model or set --model_family"
        )
    model_type = str(config.get("model_type", ""))
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise ConfigError(
            f"unknown model_type {model_type!r} in {path}/config.json; set --model_family to one of "
            f"{', '.join(FAMILIES)}"
        )
    return family


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


def qwen_hf_processor(family: str, checkpoint: Path | None) -> Qwen2VLImageProcessorPil:
    """The checkpoint's preprocessor_config.json, or the family's public defaults with the patch geometry
    of its config.json."""
    if has_image_processor_config(checkpoint):
        return Qwen2VLImageProcessorPil.from_pretrained(str(checkpoint), local_files_only=True)
    params = dict(DEFAULTS[family])
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


def internvl_hf_processor(checkpoint: Path | None) -> tuple[GotOcr2ImageProcessorPil, int, int]:
    """(HF processor, vision patch size, tokens per tile) for an InternVL checkpoint or the defaults.

    The HF layout ("internvl") ships a GotOcr2 preprocessor_config.json; the original remote-code layout
    ("internvl_chat") ships a CLIP one, so its tiling comes from config.json (force_image_size,
    min/max_dynamic_patch) instead.
    """
    config = read_json(checkpoint / "config.json") if checkpoint else None
    config = config or {}
    vision = _vision_config(config)
    patch = _first(vision.get("patch_size", INTERNVL_PATCH_SIZE))
    ratio = float(config.get("downsample_ratio", INTERNVL_DOWNSAMPLE_RATIO))
    if config.get("model_type") != "internvl_chat" and has_image_processor_config(checkpoint):
        hf = GotOcr2ImageProcessorPil.from_pretrained(str(checkpoint), local_files_only=True)
    else:
        params = dict(DEFAULTS["internvl"])
        tile = config.get("force_image_size") or vision.get("image_size")
        if tile:
            params["size"] = {"height": _first(tile), "width": _first(tile)}
        params["max_patches"] = int(config.get("max_dynamic_patch", params["max_patches"]))
        params["min_patches"] = int(config.get("min_dynamic_patch", params["min_patches"]))
        hf = GotOcr2ImageProcessorPil.from_dict(params)
    tile_h, tile_w = int(hf.size["height"]), int(hf.size["width"])
    if tile_h % patch or tile_w % patch:
        raise ConfigError(f"InternVL tile {tile_w}x{tile_h} is not a multiple of the vision patch {patch}")
    tokens_per_tile = round((tile_h // patch) * (tile_w // patch) * ratio * ratio)
    return hf, patch, tokens_per_tile
