"""load_image_processor: a family's processor from a checkpoint, a --model value or a family name, clamped
to the per-image token budget (the package's docstring, vitserve/processors, says how it is used)."""

from __future__ import annotations

import logging
from pathlib import Path

from vitserve.checkpoint import Checkpoint
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, FAMILY_CHOICES, check_geometry
from vitserve.processors.base import VisionProcessor
from vitserve.processors.hf_config import internvl_hf_processor, qwen_hf_processor
from vitserve.processors.internvl import InternVLProcessor
from vitserve.processors.pixels import Backend
from vitserve.processors.qwen import QwenProcessor


def _patches(
    family: str, checkpoint: Checkpoint | None, budget_tokens: int, resize: Backend
) -> VisionProcessor:
    return QwenProcessor(family, qwen_hf_processor(family, checkpoint), budget_tokens, resize)


def _tiles(
    family: str, checkpoint: Checkpoint | None, budget_tokens: int, resize: Backend
) -> VisionProcessor:
    hf, patch, tokens_per_tile = internvl_hf_processor(family, checkpoint)
    return InternVLProcessor(
        family, hf, budget_tokens, patch_size=patch, tokens_per_tile=tokens_per_tile, resize=resize
    )


# One builder per registry layout; every model_type the registry accepts resolves to one of these.
_BUILDERS = {"patches": _patches, "tiles": _tiles}
assert {f.layout for f in FAMILIES.values()} <= set(_BUILDERS), "a registry layout has no processor"

log = logging.getLogger(__name__)


IMAGE_RESIZE_CHOICES = ("auto", "torch", "pil")


def resolved_resize(resize: str) -> Backend:
    """--image_resize: auto is torch, the processor vLLM and SGLang use (docs/processing.md)."""
    if resize not in IMAGE_RESIZE_CHOICES:
        raise ConfigError(f"--image_resize {resize!r} is not one of {', '.join(IMAGE_RESIZE_CHOICES)}")
    return "pil" if resize == "pil" else "torch"


def load_image_processor(
    source: Checkpoint | str | Path,
    budget_tokens: int = 0,
    *,
    family: str = "auto",
    resize: str = "auto",
) -> VisionProcessor:
    """A family processor clamped to ``budget_tokens`` image tokens per image (0 = exactly as HF ships it).

    ``source``: the opened checkpoint, a --model value (vitserve/checkpoint.py opens it), or a family name
    (the family's public defaults).
    ``family``: --model_family, for a --model value ("auto": config.json's model_type decides).
    ``resize`` (--image_resize): "torch" (= "auto") gives the pixels of transformers' torchvision ("fast")
    processor, "pil" those of its PIL processor.
    """
    if budget_tokens < 0:
        raise ConfigError(f"--visual_batch_max_tokens must be >= 0, got {budget_tokens}")
    checkpoint, family = _resolve(source, family)
    proc = _BUILDERS[FAMILIES[family].layout](family, checkpoint, budget_tokens, resolved_resize(resize))
    if checkpoint is not None:
        check_geometry(proc.clamp_info(), checkpoint.stated_grid())  # before any rank starts
    proc.checkpoint = checkpoint
    _warn_if_minimum_above_budget(proc)
    return proc


def _resolve(source: Checkpoint | str | Path, family: str) -> tuple[Checkpoint | None, str]:
    """(the checkpoint, or None for a family's defaults; the family name)."""
    if family not in FAMILY_CHOICES:
        raise ConfigError(f"--model_family {family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    if isinstance(source, Checkpoint):
        return source, source.family.name
    if str(source) in FAMILIES:
        return None, str(source)
    checkpoint = Checkpoint.open(source, family)
    return checkpoint, checkpoint.family.name


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
