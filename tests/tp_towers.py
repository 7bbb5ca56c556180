"""Tiny real Hugging Face vision towers for every family, built from config classes with a fixed seed.

Used by the TP and reservation tests until tests/checkpoints.py (the "model" helper's tiny checkpoints)
is on main. Sizes are chosen so that TP=1, 2 and 4 all shard evenly (4 heads, MLP widths divisible by 4).
"""

from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl")
PATCH = 2  # Qwen patch size: pixel rows are 3 * 2 * 2 * 2 = 24 features
MERGE = 2
INTERNVL_IMAGE, INTERNVL_PATCH = 16, 4  # one tile = 4x4 patches -> 2x2 = 4 tokens after pixel shuffle


def vision_config(family: str, *, heads: int = 4, width: int = 32, mlp: int = 48, qk_norm: bool = True):
    """A tiny vision config of the family (InternVL: the full InternVLConfig, whose vision_config is used)."""
    common = {
        "depth": 2,
        "num_heads": heads,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
    }
    if family == "qwen2_vl":
        from transformers import Qwen2VLVisionConfig

        return Qwen2VLVisionConfig(embed_dim=width, hidden_size=24, mlp_ratio=max(1, mlp // width), **common)
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import Qwen2_5_VLVisionConfig

        # window of 2x2 merged tokens; block 1 is a full-attention block
        return Qwen2_5_VLVisionConfig(
            hidden_size=width,
            intermediate_size=mlp,
            out_hidden_size=24,
            window_size=PATCH * MERGE * 2,
            fullatt_block_indexes=[1],
            **common,
        )
    if family in ("qwen3_vl", "qwen3_5"):
        if family == "qwen3_vl":
            from transformers.models.qwen3_vl import Qwen3VLVisionConfig as cls

            extra = {"deepstack_visual_indexes": [0]}
        else:
            from transformers.models.qwen3_5 import Qwen3_5VisionConfig as cls

            extra = {}
        return cls(
            hidden_size=width,
            intermediate_size=mlp,
            out_hidden_size=24,
            num_position_embeddings=16,
            **common,
            **extra,
        )
    if family == "internvl":
        from transformers import InternVLConfig

        vision = {
            "hidden_size": width,
            "num_attention_heads": heads,
            "intermediate_size": mlp,
            "num_hidden_layers": 2,
            "image_size": INTERNVL_IMAGE,
            "patch_size": INTERNVL_PATCH,
            "use_qk_norm": qk_norm,
            "norm_type": "rms_norm" if qk_norm else "layer_norm",
            "use_mean_pooling": False,
        }
        text = {
            "model_type": "qwen2",
            "hidden_size": 24,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 64,
        }
        return InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5)
    raise ValueError(family)


class InternVLVisual(nn.Module):
    """InternVL's vision tower + pixel shuffle + projector: what InternVLModel.get_image_features runs."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        # like vitserve/model/internvl.py: no .config of its own, downsample_ratio as an attribute
        self.downsample_ratio = config.downsample_ratio
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        from transformers.models.internvl.modeling_internvl import InternVLModel

        feats = self.vision_tower(pixel_values=pixel_values).last_hidden_state[:, 1:, :]  # drop CLS
        n, seq, dim = feats.shape
        side = int(seq**0.5)
        feats = InternVLModel.pixel_shuffle(None, feats.reshape(n, side, side, dim), self.downsample_ratio)
        return self.multi_modal_projector(feats.reshape(n, -1, feats.shape[-1]))  # (tiles, tokens, out)


def build_visual(family: str, seed: int = 0, **cfg_kwargs) -> nn.Module:
    """The family's tower (+ merger/projector) with seeded random weights, float32, eval mode."""
    cfg = vision_config(family, **cfg_kwargs)
    torch.manual_seed(seed)
    if family == "internvl":
        cfg.vision_config._attn_implementation = "sdpa"
        visual = InternVLVisual(cfg)
    else:
        cfg._attn_implementation = "sdpa"
        visual = _qwen_class(family)(cfg)
    _reinit(visual, seed)
    return visual.eval()


def _qwen_class(family: str):
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as cls,
        )
    elif family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as cls,
        )
    elif family == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as cls
    return cls


def _reinit(module: nn.Module, seed: int) -> None:
    """Non-trivial weights everywhere (HF inits norms to 1 / biases to 0, which would hide sharding bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(
                torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 and "weight" in _ else 0.0)
            )


def packed_inputs(family: str, seed: int = 1):
    """A packed batch of mixed sizes: Qwen (pixel rows, grid_thw); InternVL (tiles, None)."""
    gen = torch.Generator().manual_seed(seed)
    if family == "internvl":
        return torch.randn(3, 3, INTERNVL_IMAGE, INTERNVL_IMAGE, generator=gen), None  # 3 tiles
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]  # patch grids, multiples of merge size
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(rows, 3 * 2 * PATCH * PATCH, generator=gen)  # (patches, C*T*P*P)
    return pixels, torch.tensor(grids)


def run_visual(visual: nn.Module, family: str, pixels, grid) -> list[torch.Tensor]:
    """Forward and return every output tensor (merged embeddings, deepstack features)."""
    with torch.no_grad():
        if family == "internvl":
            return [visual(pixels)]
        out = visual(pixels, grid_thw=grid)
    return [out.pooler_output, *list(getattr(out, "deepstack_features", None) or [])]
