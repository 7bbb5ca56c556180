"""vitserve.model.fast.optimize: the optimized towers equal HF's forward on packed batches (fp32 round-off)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import InternVLVisionConfig, InternVLVisionModel
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from vitserve.errors import ConfigError
from vitserve.model.fast import optimize
from vitserve.model.fast_attention import build_plan, packed_attention


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to fp32 round-off: max error within 1e-5 of the tensor's own scale (max |want|)."""
    assert got.shape == want.shape
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * scale, f"max abs error {err:.3g} > 1e-5 x scale {scale:.3g}"


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights of unit-scale activations, so attention is not uniform and every path matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=gen) * 1.5 / math.sqrt(fan_in))
            elif "norm" in name or "ln_" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def make_tower(family: str, seed: int = 0) -> nn.Module:
    """A tiny seeded HF vision tower of `family`, shaped like the real ones (window/full blocks, deepstack)."""
    common = {"depth": 4, "num_heads": 4}
    if family == "qwen2_vl":
        cfg = Qwen2VLVisionConfig(**common, embed_dim=64, hidden_size=48, mlp_ratio=2, patch_size=14)
        return _randomize(Qwen2VisionTransformerPretrainedModel(cfg), seed)
    if family == "qwen2_5_vl":
        cfg = Qwen2_5_VLVisionConfig(
            **common, hidden_size=64, intermediate_size=96, out_hidden_size=48, patch_size=14,
            window_size=112, fullatt_block_indexes=[1, 3],
        )  # fmt: skip
        return _randomize(Qwen2_5_VisionTransformerPretrainedModel(cfg), seed)
    if family == "qwen3_vl":
        cfg = Qwen3VLVisionConfig(
            **common, hidden_size=64, intermediate_size=96, out_hidden_size=48, patch_size=16,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
        )  # fmt: skip
        return _randomize(Qwen3VLVisionModel(cfg), seed)
    if family == "qwen3_5":
        cfg = Qwen3_5VisionConfig(
            **common, hidden_size=64, intermediate_size=96, out_hidden_size=48, patch_size=16,
            num_position_embeddings=64,
        )  # fmt: skip
        return _randomize(Qwen3_5VisionModel(cfg), seed)
    raise AssertionError(family)


def _packed_inputs(tower: nn.Module, grids: list[tuple[int, int, int]], seed: int = 1):
    cfg = tower.config
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    grid_thw = torch.tensor(grids)  # (B, 3)
    n_patches = int(grid_thw.prod(-1).sum())
    pixels = torch.randn(n_patches, patch_dim, generator=torch.Generator().manual_seed(seed))
    return pixels, grid_thw


# Grids in patches (t, h, w); the Qwen2.5 window is 8x8 patches here (112 px / 14 px), merge 2.
GRIDS = {
    "single": [(1, 8, 8)],
    "mixed": [(1, 4, 6), (1, 18, 22), (1, 8, 8), (1, 2, 2)],  # 18x22: partial windows on both edges
    "odd_merged_grid": [(1, 6, 10), (1, 14, 2)],  # 3x5 and 7x1 merged tokens
    "many_equal": [(1, 8, 12)] * 6,
    "equal_then_other": [(1, 8, 8)] * 3 + [(1, 10, 6)] + [(1, 8, 8)] * 2,  # equal images not back to back
}
QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


@pytest.fixture(scope="module", params=QWEN)
def towers(request):
    family = request.param
    reference = make_tower(family)
    return family, reference, optimize(copy.deepcopy(reference), family)


@pytest.mark.parametrize("case", list(GRIDS))
def test_optimized_equals_hf_on_packed_batches(towers, case):
    family, reference, fast = towers
    pixels, grid_thw = _packed_inputs(reference, GRIDS[case])
    with torch.inference_mode():
        want = reference(pixels, grid_thw)
        got = fast(pixels, grid_thw)
    assert_close(got.pooler_output, want.pooler_output)
    assert_close(got.last_hidden_state, want.last_hidden_state)
    if family == "qwen3_vl":
        assert len(got.deepstack_features) == len(want.deepstack_features) == 2
        for g, w in zip(got.deepstack_features, want.deepstack_features, strict=True):
            assert_close(g, w)


def test_packed_equals_one_at_a_time(towers):
    """Invariant 8 through the optimized path: an image's embedding does not depend on its batch."""
    family, _, fast = towers
    grids = GRIDS["mixed"]
    pixels, grid_thw = _packed_inputs(fast, grids)
    with torch.inference_mode():
        packed = fast(pixels, grid_thw).pooler_output
        alone = [
            fast(p, g[None]).pooler_output for p, g in zip(_split(pixels, grid_thw), grid_thw, strict=True)
        ]
    assert_close(packed, torch.cat(alone))


def _split(pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(pixels, grid_thw.prod(-1).tolist()))


def test_optimize_patches_forwards_and_keeps_weights():
    tower = make_tower("qwen2_5_vl")
    before = {name: p.data_ptr() for name, p in tower.named_parameters()}
    names_before = [name for name, _ in tower.named_modules()]
    optimize(tower, "qwen2_5_vl")
    assert {name: p.data_ptr() for name, p in tower.named_parameters()} == before  # nothing copied
    assert [name for name, _ in tower.named_modules()] == names_before  # TP finds the same submodules
    attn = tower.blocks[0].attn
    assert attn.forward.__func__.__module__ == "vitserve.model.fast"
    assert tower.patch_embed.forward.__func__.__module__ == "vitserve.model.fast"
    assert tower.blocks[0].mlp.forward.__func__.__module__ == "vitserve.model.fast_mlp"


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown family"):
        optimize(nn.Linear(2, 2), "llava")


def test_internvl_keeps_hf_math_and_uses_sdpa():
    cfg = InternVLVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=[56, 56],
        patch_size=[14, 14], attn_implementation="eager",
    )  # fmt: skip
    reference = _randomize(InternVLVisionModel(cfg), 0)
    fast = optimize(copy.deepcopy(reference), "internvl")
    assert fast.config._attn_implementation == "sdpa"
    tiles = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert_close(fast(tiles).last_hidden_state, reference(tiles).last_hidden_state)


def test_plan_groups_equal_lengths_and_runs_them_as_one_call():
    cu_seqlens = torch.tensor([0, 4, 8, 11, 15, 15, 19, 21], dtype=torch.int32)  # lengths 4 4 3 4 0 4 2
    plan = build_plan(cu_seqlens)
    assert plan.total == 21
    assert [(g.length, g.count) for g in plan.groups] == [(4, 4), (3, 1), (2, 1)]
    assert plan.groups[0].index is not None  # the 4s are not back to back: gathered
    assert plan.groups[1].index is None  # a single segment is a slice
    assert plan.groups[1].start == 8
    q, k, v = torch.randn(3, 21, 2, 8).unbind(0)  # (N, H, D) each
    got = packed_attention(q, k, v, plan, scale=0.3)
    bounds = cu_seqlens.tolist()
    want = [
        torch.softmax(q[a:b].transpose(0, 1) @ k[a:b].transpose(0, 1).mT * 0.3, -1) @ v[a:b].transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        if b > a
    ]  # per segment (H, L, D), the loop HF runs
    assert_close(got, torch.cat([w.transpose(0, 1).reshape(w.shape[1], -1) for w in want]))
