"""Per-model_type torch facts in one table: which transformers classes build the tower, where its weights live in a
checkpoint, how one packed forward runs and what comes out. Everything else in vitserve/model is generic."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from vitserve.families import FAMILIES, MODEL_TYPES, family_of_model_type

if TYPE_CHECKING:  # transformers is imported only when a tower is built
    from transformers import InternVLConfig, PreTrainedConfig

    from vitserve.model.tower_graphs import TowerRunner

# Qwen towers live under `model.visual.*` (transformers 5 layout) or `visual.*` (original hub layout); the
# module built here is the tower itself, so both prefixes map to "".
_QWEN_KEYS = (("model.visual.", ""), ("visual.", ""))
# InternVL: the wrapper module (vitserve.model.internvl.InternVLVisual) keeps HF's submodule names.
_INTERNVL_KEYS = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)

ForwardFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]


def _qwen_forward(
    visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """pixel_values (sum patches, C*T*P*P), grid_thw (N, 3) -> merged rows (sum tokens, dim) + deepstack."""
    if (runner := _runner(visual)) is not None:  # CUDA graphs per token bucket (model/tower_graphs.py)
        return runner.forward(pixel_values, grid_thw)
    out = visual(pixel_values, grid_thw=grid_thw)
    deepstack = getattr(out, "deepstack_features", None) or []
    return out.pooler_output, list(deepstack)


def _qwen_windowed_forward(
    visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """_qwen_forward with the per-grid set-up (position ids, cu_seqlens, window index) passed precomputed."""
    from vitserve.model.grid_setup import grid_setups

    if (runner := _runner(visual)) is not None:
        return runner.forward(pixel_values, grid_thw)
    out = visual(pixel_values, grid_thw=grid_thw, **grid_setups(visual).kwargs(visual, grid_thw))
    return out.pooler_output, []


def _runner(visual: nn.Module) -> TowerRunner | None:
    """The TowerRunner installed on `visual` (vitserve.model.tower_graphs.install), or None."""
    runner: TowerRunner | None = visual.__dict__.get("_vitserve_runner")
    return runner


def _internvl_forward(
    visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """pixel_values (tiles, C, H, W) -> (tiles * tokens_per_tile, dim); grid_thw is not needed."""
    out = visual(pixel_values)  # (tiles, tokens_per_tile, dim)
    return out.reshape(-1, out.shape[-1]), []


def _qwen2_embed_dim(vision_config: PreTrainedConfig) -> int:
    # Qwen2-VL: `embed_dim` is the tower width, `hidden_size` the merger output
    width: int = vision_config.hidden_size
    return width


def _out_hidden(vision_config: PreTrainedConfig) -> int:
    width: int = vision_config.out_hidden_size
    return width


def _deepstack(vision_config: PreTrainedConfig) -> int:
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or [])


@dataclass(frozen=True)
class FamilyAdapter:
    family: str  # the vitserve family name
    config_class: str  # transformers top-level config class of the full model
    build: Callable[
        [PreTrainedConfig], nn.Module
    ]  # (full config) -> the vision module, on the current default device
    key_prefixes: tuple[tuple[str, str], ...]  # (checkpoint prefix, module prefix)
    forward: ForwardFn
    embed_dim: Callable[[PreTrainedConfig], int]  # (full config) -> output columns
    num_deepstack: Callable[[PreTrainedConfig], int] = lambda config: 0

    def config_cls(self) -> type[PreTrainedConfig]:
        import transformers

        config_cls: type[PreTrainedConfig] = getattr(transformers, self.config_class)
        return config_cls

    def hf_config(self, config_json: Mapping[str, Any]) -> PreTrainedConfig:
        """The transformers config of the full model from config.json's content (vitserve/checkpoint.py
        read it): what from_pretrained builds once it has read the file."""
        return self.config_cls().from_dict(copy.deepcopy(dict(config_json)))


def _hf_tower(path: str) -> Callable[[PreTrainedConfig], nn.Module]:
    """Build transformers' tower class ("module:Class" under transformers.models) from config.vision_config."""

    def build(config: PreTrainedConfig) -> nn.Module:
        module_name, cls_name = path.split(":")
        cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), cls_name)
        tower: nn.Module = cls._from_config(config.vision_config)
        return tower

    return build


def _internvl_build(config: PreTrainedConfig) -> nn.Module:
    from vitserve.model.internvl import InternVLVisual

    # cast: the "internvl" adapter's config_class is InternVLConfig, so this is the config its loader built
    return InternVLVisual(cast("InternVLConfig", config))


def _qwen(
    family: str,
    config_class: str,
    vision_class: str,
    embed_dim: Callable[[PreTrainedConfig], int],
    deepstack: Callable[[PreTrainedConfig], int] = lambda c: 0,
    forward: ForwardFn = _qwen_forward,
) -> FamilyAdapter:
    return FamilyAdapter(
        family=family,
        config_class=config_class,
        build=_hf_tower(vision_class),
        key_prefixes=_QWEN_KEYS,
        forward=forward,
        embed_dim=lambda config: embed_dim(config.vision_config),
        num_deepstack=lambda config: deepstack(config.vision_config),
    )


# Keyed by config.json model_type; MoE variants share their dense family's tower and processor.
ADAPTERS: dict[str, FamilyAdapter] = {
    "qwen2_vl": _qwen(
        "qwen2_vl",
        "Qwen2VLConfig",
        "qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
        _qwen2_embed_dim,
    ),
    "qwen2_5_vl": _qwen(
        "qwen2_5_vl",
        "Qwen2_5_VLConfig",
        "qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
        _out_hidden,
        forward=_qwen_windowed_forward,
    ),
    "qwen3_vl": _qwen(
        "qwen3_vl", "Qwen3VLConfig", "qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel", _out_hidden, _deepstack
    ),
    "qwen3_vl_moe": _qwen(
        "qwen3_vl",
        "Qwen3VLMoeConfig",
        "qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeVisionModel",
        _out_hidden,
        _deepstack,
    ),
    "qwen3_5": _qwen("qwen3_5", "Qwen3_5Config", "qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel", _out_hidden),
    "qwen3_5_moe": _qwen(
        "qwen3_5", "Qwen3_5MoeConfig", "qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeVisionModel", _out_hidden
    ),
    "internvl": FamilyAdapter(
        family="internvl",
        config_class="InternVLConfig",
        build=_internvl_build,
        key_prefixes=_INTERNVL_KEYS,
        forward=_internvl_forward,
        embed_dim=lambda config: config.text_config.hidden_size,
    ),
}


assert set(ADAPTERS) == set(MODEL_TYPES), "model/adapters.py must cover every registry model_type"
assert all(ADAPTERS[mt].family == f.name for f in FAMILIES.values() for mt in f.model_types)


def resolve_adapter(model_type: str | None, family: str = "auto") -> FamilyAdapter:
    """The adapter for a checkpoint's model_type, or for an explicit --model_family (which wins).

    The family comes from vitserve.families.family_of_model_type, the same check the processors use."""
    resolved = family_of_model_type(model_type or "", family)
    adapter = ADAPTERS.get(model_type or "")
    # Keep the MoE variant's classes when the checkpoint is one; otherwise use the family's own.
    return adapter if adapter is not None and adapter.family == resolved.name else ADAPTERS[resolved.name]
