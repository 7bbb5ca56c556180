"""The flags of the encoder's budget: tokens per batch and per video, images per batch, the queue's bound,
and the GPU memory the ranks reserve or size the budget to (--visual_mem_gb, docs/engine.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags.spec import Flag, check_positive, optional, parse_bool, parse_int

BUDGET: dict[str, Flag] = {
    "visual_batch_max_tokens": Flag(
        parse_int, "budget and limits", "token budget per batch AND per image (after merge); 0 disables"
    ),
    "visual_infer_batch_size": Flag(parse_int, "budget and limits", "at most this many images per batch"),
    "max_video_tokens": Flag(
        parse_int,
        "budget and limits",
        "tokens one video may cost in all (after merge): its frames shrink to fit; 0 disables",
    ),
    "visual_reserved_mem_gb": Flag(
        optional(float),
        "budget and limits",
        "skip the start-up stress and reserve this much",
        "none (measure at start-up)",
    ),
    "cuda_graphs": Flag(
        parse_bool,
        "budget and limits",
        "CUDA, bf16/fp16, --tp 1, Qwen towers: replay the tower's forward from CUDA graphs captured per token "
        "bucket at start-up (their pool is added to the reservation); not yet measured on a GPU",
    ),
    "visual_mem_gb": Flag(
        optional(float),
        "budget and limits",
        "choose the largest budget whose worst case fits this many GiB per rank (beside the weights)",
        "none (the budget is --visual_batch_max_tokens)",
    ),
    "max_queue_tokens": Flag(
        optional(parse_int), "budget and limits", "queued tokens above which requests get 503", "4 x budget"
    ),
}


def budget_source(values: Mapping[str, Any]) -> dict[str, Any]:
    """--visual_mem_gb without --visual_batch_max_tokens: the ranks choose the budget (0 until they have);
    with it, the flag's budget stands and is checked against the target (docs/engine.md)."""
    if values.get("visual_mem_gb") is None or "visual_batch_max_tokens" in values:
        return {}
    return {"visual_batch_max_tokens": 0, "budget_source": "visual_mem_gb"}


def validate(config: Config) -> None:
    check_positive(config, "visual_infer_batch_size")
    check_positive(
        config,
        "visual_batch_max_tokens",
        "max_video_tokens",
        "max_queue_tokens",
        "visual_reserved_mem_gb",
        allow_zero=True,
    )
    if config.visual_mem_gb is None:
        return
    if config.visual_mem_gb <= 0:
        raise ConfigError(f"--visual_mem_gb must be > 0, got {config.visual_mem_gb}")
    if config.visual_reserved_mem_gb is not None:
        raise ConfigError(
            "--visual_mem_gb sizes the budget by measuring it and --visual_reserved_mem_gb skips the "
            "measurement; set one of them"
        )
