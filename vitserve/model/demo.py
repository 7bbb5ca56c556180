"""The built-in "demo" model: a seeded, randomly initialised Qwen2.5-VL-shaped tower for trying the service.

Shaped like the public Qwen2.5-VL processor defaults (patch 14, merge 2, temporal 2) so the "demo"
processor's token counts match it; small enough to run on a CPU. Its embeddings mean nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitserve.families import DEMO_VISION_CONFIG

if TYPE_CHECKING:  # transformers is imported lazily: the demo config is built only for --model demo
    from transformers import Qwen2_5_VLConfig

DEMO_SEED = 0

log = logging.getLogger(__name__)


def demo_config() -> Qwen2_5_VLConfig:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(vision_config=DEMO_VISION_CONFIG)


def build_demo_visual() -> nn.Module:
    """The demo tower on CPU in float32, weights drawn from a fixed seed (same tower in every process)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    log.warning(
        "\n%s\n  --model demo: a RANDOMLY INITIALISED Qwen2.5-VL-shaped vision tower (seed %d).\n"
        "  Its embeddings MEAN NOTHING. Use it to try the service, never with a real LLM.\n%s",
        "!" * 78,
        DEMO_SEED,
        "!" * 78,
    )
    config = demo_config()
    devnull_rng = torch.random.fork_rng()  # keep the caller's global RNG untouched
    with devnull_rng:
        torch.manual_seed(DEMO_SEED)
        visual: nn.Module = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
    return visual.eval()
