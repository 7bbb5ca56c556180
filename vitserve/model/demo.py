"""Towers whose weights are drawn from a seed instead of read from files: the demo (vitserve/checkpoint.py,
`Checkpoint.demo`), a Qwen2.5-VL-shaped tower for trying the service. Its embeddings mean nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitserve.checkpoint import Checkpoint
from vitserve.model.adapters import FamilyAdapter, resolve_adapter

if TYPE_CHECKING:  # transformers is imported only when a tower is built
    from transformers import PreTrainedConfig

log = logging.getLogger(__name__)


def seeded_visual(adapter: FamilyAdapter, config: PreTrainedConfig, checkpoint: Checkpoint) -> nn.Module:
    """The tower on CPU in float32, weights drawn from the checkpoint's seed (the same in every process)."""
    assert checkpoint.seed is not None, "only a seeded checkpoint has no weight files"
    log.warning(
        "\n%s\n  --model %s: a RANDOMLY INITIALISED %s-shaped vision tower (seed %d).\n"
        "  Its embeddings MEAN NOTHING. Use it to try the service, never with a real LLM.\n%s",
        "!" * 78,
        checkpoint.name,
        checkpoint.family.display,
        checkpoint.seed,
        "!" * 78,
    )
    with torch.random.fork_rng():  # keep the caller's global RNG untouched
        torch.manual_seed(checkpoint.seed)
        visual = adapter.build(config)
    return visual.eval()


def build_demo_visual() -> nn.Module:
    """The demo's tower as HF builds it (no fast kernels): for the benchmarks' baselines."""
    checkpoint = Checkpoint.demo()
    adapter = resolve_adapter(checkpoint.model_type, checkpoint.family.name)
    return seeded_visual(adapter, adapter.hf_config(checkpoint.config), checkpoint)
