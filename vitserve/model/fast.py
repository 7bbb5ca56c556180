"""Exact, faster forwards for the HF vision towers, patched onto the instances in place.

What is slow in HF's packed forward (measured in bench/encoder.py, see bench/RESULTS.md and bench/history/0.1.0.md):
  * attention over packed segments loops in Python, one SDPA call per window / image;
  * patch embedding runs a Conv3d whose kernel equals its stride, i.e. a linear map on each flat patch;
  * rotary embedding builds several full-size temporaries per layer (float copies, rotate_half's cat);
  * on CPU, every linear layer runs MKL's sgemm after a copy of the bias into each output row (fast_linear.py
    routes them through oneDNN's matmul instead).
Each replacement computes the same math, so outputs equal HF's to fp32 round-off.

Contract with the tensor-parallel pass (vitserve/model/tp.py): every HF submodule keeps its name and is
called as a module (qkv, proj, fc1, fc2, gate_proj, up_proj, down_proj, linear_fc1, linear_fc2, q_proj, ...),
and the head count is read from `self.num_heads` at forward time (TP sets it to the local count); the head
dim comes from the width of qkv's output. No weight is copied or cached here.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitserve.errors import ConfigError
from vitserve.families import FAMILIES
from vitserve.model.fast_alloc import tune_cpu_allocator
from vitserve.model.fast_attention import PlanCache, packed_attention
from vitserve.model.fast_linear import linear, use_onednn_linears
from vitserve.model.fast_mlp import inplace_activation, is_rms_norm, mlp_kind, rms_norm_forward
from vitserve.model.fast_varlen import count_grouped, varlen_attention


def optimize(visual: nn.Module, family: str) -> nn.Module:
    """Patch the slow forwards of `visual` (a vision tower of `family`) in place; returns `visual`."""
    if family not in FAMILIES:
        raise ConfigError(
            f"vitserve.model.fast.optimize: unknown family {family!r}; known: {', '.join(FAMILIES)}"
        )
    if _on_cpu(visual):
        tune_cpu_allocator()
        use_onednn_linears(visual)
    if FAMILIES[family].layout == "tiles":
        _use_sdpa(visual)  # a plain ViT on fixed tiles: attention is already one batched call per layer
        return visual
    plans = PlanCache()  # one per tower: its layers share each forward's cu_seqlens
    for module in visual.modules():
        _optimize_module(module, plans)
    return visual


def _optimize_module(module: nn.Module, plans: PlanCache) -> None:
    if _is_qwen_attention(module) and not _flash_requested(module):
        setattr(module, "_vitserve_plans", plans)  # noqa: B010 (nn.Module's typed __setattr__)
        _patch(module, qwen_attention_forward)
    elif _is_linear_patch_embed(module):
        _patch(module, linear_patch_embed_forward)
    elif is_rms_norm(module):
        _patch(module, rms_norm_forward)
    elif (kind := mlp_kind(module)) is not None:
        forward, act = kind
        setattr(module, "_vitserve_inplace_act", inplace_activation(act))  # noqa: B010
        _patch(module, forward)


def _on_cpu(visual: nn.Module) -> bool:
    param = next(visual.parameters(), None)
    return param is None or param.device.type == "cpu"


def _patch(module: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    module.forward = types.MethodType(forward, module)


def _is_qwen_attention(module: nn.Module) -> bool:
    # proj may already be TP's RowParallelLinear (an nn.Module, not an nn.Linear): the forward only calls it
    return (
        isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "proj", None), nn.Module)
        and hasattr(module, "num_heads")
        and hasattr(module, "scaling")
    )


def _flash_requested(module: nn.Module) -> bool:
    # HF's flash-attention path already runs varlen attention in one call; keep it.
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None) or ""
    return "flash" in impl


def _is_linear_patch_embed(module: nn.Module) -> bool:
    conv = getattr(module, "proj", None)
    return (
        isinstance(conv, nn.Conv3d)
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and conv.padding == (0, 0, 0)
        and conv.dilation == (1, 1, 1)
        and conv.groups == 1
    )


def _use_sdpa(visual: nn.Module) -> None:
    for module in visual.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "eager":
            config._attn_implementation = "sdpa"


def linear_patch_embed_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Conv3d with kernel == stride over one patch is a matmul with the flattened kernel."""
    conv = self.proj
    weight = conv.weight.reshape(conv.out_channels, -1)  # (E, C*T*P*P), a view
    x = hidden_states.reshape(-1, weight.shape[1]).to(weight.dtype)  # (N, C*T*P*P)
    return linear(x, weight, conv.bias)  # (N, E)


def qwen_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Same signature and math as HF's Qwen*VisionAttention.forward (SDPA path)."""
    n_tokens = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).view(n_tokens, 3, self.num_heads, -1)  # (N, 3, H, D); H read now (TP)
    if position_embeddings is None:  # HF's tower always passes them; say so rather than fail obscurely
        raise TypeError("qwen_attention_forward needs position_embeddings (cos, sin)")
    cos, sin = position_embeddings  # (N, D) each
    qk = apply_rotary(qkv[:, :2], cos, sin)  # (N, 2, H, D)
    out = None
    if hidden_states.is_cuda:  # half precision: one varlen call for every segment (fast_varlen.py)
        if max_seqlen is None:
            max_seqlen = self._vitserve_plans.get(cu_seqlens).max_length
        out = varlen_attention(qk[:, 0], qk[:, 1], qkv[:, 2], cu_seqlens, int(max_seqlen), self.scaling)
    if out is None:
        count_grouped()  # which attention served: bench/gpu_check.py reads fast_varlen.kernels_ran
        plan = self._vitserve_plans.get(cu_seqlens)
        out = packed_attention(qk[:, 0], qk[:, 1], qkv[:, 2], plan, self.scaling)  # (N, H*D)
    projected: torch.Tensor = self.proj(out)
    return projected


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` (computed in fp32) without the rotate_half copy.

    x: (N, ..., D); cos, sin: (N, D). With x = [x1, x2] and c, s split the same way:
    out1 = x1 * c1 - x2 * s1, out2 = x2 * c2 + x1 * s2.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().view(shape), sin.float().view(shape)  # (N, 1.., D)
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    x1, x2 = xf[..., :half], xf[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c[..., :half], out=o1)
    o1.addcmul_(x2, s[..., :half], value=-1.0)
    torch.mul(x2, c[..., half:], out=o2)
    o2.addcmul_(x1, s[..., half:])
    return out.to(x.dtype)
