"""MLP and norm forwards with fewer full-size temporaries (same math as HF's, same submodules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor]


def inplace_activation(act: nn.Module) -> Activation | None:
    """An in-place twin of the HF activation module `act`, or None when there is none we trust exact."""
    name = type(act).__name__
    if name in ("SiLUActivation", "SiLU"):
        return lambda x: F.silu(x, inplace=True)
    if name == "GELUTanh" and getattr(getattr(act, "act", None), "func", None) is F.gelu:
        return lambda x: torch.ops.aten.gelu_(x, approximate="tanh")
    if name == "GELUActivation" and getattr(act, "act", None) is F.gelu:
        return torch.ops.aten.gelu_
    if name == "GELU":  # torch.nn.GELU
        return lambda x: torch.ops.aten.gelu_(x, approximate=act.approximate)
    if name == "QuickGELUActivation":
        return lambda x: x.mul_(torch.sigmoid(1.702 * x))  # HF: x * sigmoid(1.702 * x)
    return None


def _activate(module: Any, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(x), in place on x when autograd cannot need x (x is a fresh Linear output)."""
    inplace = module._vitserve_inplace_act
    out: torch.Tensor = act(x) if inplace is None or torch.is_grad_enabled() else inplace(x)
    return out


def gated_mlp_forward(self: Any, hidden_state: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), the product written into gate's output."""
    gate = _activate(self, self.act_fn, self.gate_proj(hidden_state))  # (N, I)
    up = self.up_proj(hidden_state)  # (N, I)
    gate = gate * up if torch.is_grad_enabled() else gate.mul_(up)
    out: torch.Tensor = self.down_proj(gate)
    return out


def fc_mlp_forward(self: Any, hidden_state: torch.Tensor) -> torch.Tensor:
    """Qwen2-VL (fc1/act/fc2) and Qwen3-VL / Qwen3.5 (linear_fc1/act_fn/linear_fc2)."""
    out: torch.Tensor
    if hasattr(self, "fc1"):
        out = self.fc2(_activate(self, self.act, self.fc1(hidden_state)))
    else:
        out = self.linear_fc2(_activate(self, self.act_fn, self.linear_fc1(hidden_state)))
    return out


def mlp_kind(module: nn.Module) -> tuple[Callable[..., torch.Tensor], nn.Module] | None:
    """(the forward to patch in, its activation module) when `module` is a known vision MLP shape."""
    children = dict(module.named_children())
    names = set(children)
    if {"gate_proj", "up_proj", "down_proj", "act_fn"} <= names:
        return gated_mlp_forward, children["act_fn"]
    if names == {"fc1", "act", "fc2"}:
        return fc_mlp_forward, children["act"]
    if names == {"linear_fc1", "act_fn", "linear_fc2"}:  # the mergers also have a norm; they stay HF's
        return fc_mlp_forward, children["act_fn"]
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """HF's own RMSNorm classes only: a subclass or a TP ShardedRMSNorm (which all-reduces) keeps its forward."""
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNorm")


def rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)), in three passes over x instead of six.

    The mean of squares comes from one vector_norm reduction (F.rms_norm is not fused on CPU: measured no
    faster than HF's). Other dtypes than fp32, and autograd, keep HF's exact code.
    """
    fp32 = hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32
    if not fp32 or torch.is_grad_enabled():
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        hf_out: torch.Tensor = self.weight * x.to(input_dtype)
        return hf_out
    width = hidden_states.shape[-1]
    inv_rms = torch.linalg.vector_norm(hidden_states, dim=-1, keepdim=True)  # (N, 1)
    inv_rms = inv_rms.square_().div_(width).add_(self.variance_epsilon).rsqrt_()
    out = torch.mul(hidden_states, inv_rms)  # (N, E)
    return out.mul_(self.weight)
