"""Model-family image processors with an unbreakable per-image token budget (docs/processing.md, docs/design.md invariant 1).

Usage: ``proc = load_image_processor(checkpoint_dir | family | "demo", budget_tokens=8192)``, then
``proc.count_tokens(width, height) -> int`` and ``proc.preprocess(pil_image) -> ProcessedImage``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vitserve.errors import ConfigError
from vitserve.families import DEMO_FAMILY, FAMILIES, FAMILY_CHOICES, check_geometry
from vitserve.processors.base import VisionProcessor
from vitserve.processors.budget import Plan
from vitserve.processors.hf_config import (
    family_of_checkpoint,
    internvl_hf_processor,
    qwen_hf_processor,
    tower_geometry,
)
from vitserve.processors.internvl import InternVLProcessor
from vitserve.processors.pixels import Backend
from vitserve.processors.qwen import QwenProcessor


def _patches(family: str, checkpoint: Path | None, budget_tokens: int, resize: Backend) -> VisionProcessor:
    return QwenProcessor(family, qwen_hf_processor(family, checkpoint), budget_tokens, resize)


def _tiles(family: str, checkpoint: Path | None, budget_tokens: int, resize: Backend) -> VisionProcessor:
    hf, patch, tokens_per_tile = internvl_hf_processor(family, checkpoint)
    return InternVLProcessor(
        family, hf, budget_tokens, patch_size=patch, tokens_per_tile=tokens_per_tile, resize=resize
    )


# One builder per registry layout; every model_type the registry accepts resolves to one of these.
_BUILDERS = {"patches": _patches, "tiles": _tiles}
assert {f.layout for f in FAMILIES.values()} <= set(_BUILDERS), "a registry layout has no processor"

__all__ = [
    "Plan",
    "VisionProcessor",
    "family_of_checkpoint",
    "load_image_processor",
]

log = logging.getLogger(__name__)


IMAGE_RESIZE_CHOICES = ("auto", "torch", "pil")


def resolved_resize(resize: str) -> Backend:
    """--image_resize: auto is torch, the processor vLLM and SGLang use (docs/processing.md)."""
    if resize not in IMAGE_RESIZE_CHOICES:
        raise ConfigError(f"--image_resize {resize!r} is not one of {', '.join(IMAGE_RESIZE_CHOICES)}")
    return "pil" if resize == "pil" else "torch"


def load_image_processor(
    name_or_path: str,
    budget_tokens: int = 0,
    *,
    family: str = "auto",
    resize: str = "auto",
) -> VisionProcessor:
    """A family processor clamped to ``budget_tokens`` image tokens per image (0 = exactly as HF ships it).

    ``name_or_path``: a checkpoint directory (read offline), a family name, or "demo" (= qwen2_5_vl).
    ``family``: "auto" reads it from the checkpoint's config.json (what --model_family auto does).
    ``resize`` (--image_resize): "torch" (= "auto") gives the pixels of transformers' torchvision ("fast")
    processor, "pil" those of its PIL processor.
    """
    if budget_tokens < 0:
        raise ConfigError(f"--visual_batch_max_tokens must be >= 0, got {budget_tokens}")
    checkpoint, family = _resolve(str(name_or_path), family)
    proc = _BUILDERS[FAMILIES[family].layout](family, checkpoint, budget_tokens, resolved_resize(resize))
    check_geometry(proc.clamp_info(), tower_geometry(checkpoint))  # before any rank starts
    _warn_if_minimum_above_budget(proc)
    return proc


def _resolve(name_or_path: str, family: str) -> tuple[Path | None, str]:
    """(checkpoint dir or None, family) for a --model value and a --model_family value."""
    if family not in FAMILY_CHOICES:
        raise ConfigError(f"--model_family {family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    if name_or_path == "demo":
        return None, DEMO_FAMILY
    if name_or_path in FAMILIES:
        return None, name_or_path
    path = Path(name_or_path)
    if not path.is_dir():
        raise ConfigError(
            f"--model {name_or_path!r} is neither a checkpoint directory nor one of demo, {', '.join(FAMILIES)}"
        )
    return path, family_of_checkpoint(path, family)


def _warn_if_minimum_above_budget(proc: VisionProcessor) -> None:
    info = proc.clamp_info()
    minimum = info.get("min_tokens") or info.get("tokens_per_tile")
    if proc.budget_tokens > 0 and minimum and minimum > proc.budget_tokens:
        log.warning(
            "the %s processor's minimum of %d tokens per image is above --visual_batch_max_tokens=%d: "
            "images it must grow (or every image, for tiles) will be refused with 413 over_token_budget",
            proc.family,
            minimum,
            proc.budget_tokens,
        )
