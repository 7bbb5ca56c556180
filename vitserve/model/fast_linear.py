"""Linear layers through oneDNN's matmul on CPU: the same product as F.linear, faster at one image's size.

F.linear on CPU is MKL's sgemm behind torch's addmm, which first copies the bias into every output row and
then accumulates into it; oneDNN (bundled with torch, the kernels torch.compile's CPU backend calls) adds the
bias inside its kernel, which shortens the forward of a small batch (bench/RESULTS.md, "oneDNN linear
layers", has the measurements). The products differ from MKL's only in summation order: fp32 round-off,
like the other fast forwards.

Only where the result is certain to be the same product: CPU, float32, no autograd, a contiguous weight. A
probe the first time compares the op with F.linear; when oneDNN is missing (a build without it) or disagrees,
every call stays F.linear.

`pack_linear_weights` gives each layer a copy of its weight in oneDNN's blocked layout, so the kernel stops
reordering it on every call (without it the rank's sleeping threads ate the gain). The copy costs the linear
layers' weight memory once more, so only the rank packs, once its weights are final (after the TP pass) and
before its reservation is measured; the module's own Parameter stays as it is, and a layer whose weight was
replaced since it was packed uses the new one.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_PROBE_BOUND = 1e-5  # relative to the output's scale: fp32 round-off of a 64-term dot product is ~1e-7


@functools.cache
def onednn_linear_ok() -> bool:
    """True when torch's oneDNN linear runs here and equals F.linear to fp32 round-off (probed once)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((37, 64), (48, 64), (48,)))
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            want = F.linear(x, w, b)
    except (AttributeError, RuntimeError) as exc:  # an op missing from this build, or refused on this CPU
        log.info("oneDNN linear unavailable (%s): linear layers stay F.linear", exc)
        return False
    err = (got - want).abs().max().item()
    ok = bool(got.shape == want.shape and err <= _PROBE_BOUND * want.abs().max().item())
    if not ok:
        log.warning("oneDNN linear differs from F.linear by %.3g: linear layers stay F.linear", err)
    return ok


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias); through oneDNN when on CPU in fp32 without autograd (see the module doc).

    `packed`: `weight` in oneDNN's layout (`pack_linear_weights`), used in its place on the oneDNN path.
    """
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or torch.is_grad_enabled()
        or not weight.is_contiguous()
        or not onednn_linear_ok()
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # (N, in): the op takes 2-D input
    w = weight if packed is None else packed
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, w, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through `linear`, with the packed weight while it is still this layer's weight."""
    return linear(x, self.weight, self.bias, packed_weight(self))


def packed_weight(module: nn.Module) -> torch.Tensor | None:
    """`module.weight` in oneDNN's layout, if `pack_linear_weights` packed this very weight."""
    source, packed = module.__dict__.get("_vitserve_packed", (None, None))
    return packed if source is module.weight else None


def pack_linear_weights(visual: nn.Module) -> int:
    """Give every linear layer of `visual` that runs through `linear` its weight in oneDNN's layout; returns
    how many were (re)packed. Call once the weights are final; layers packed with their current weight are
    skipped, so calling again after the TP pass packs only what it replaced."""
    if not onednn_linear_ok():
        return 0
    count = 0
    for module in visual.modules():
        weight = getattr(module, "weight", None)
        if not (_routed(module) and isinstance(weight, torch.Tensor)) or packed_weight(module) is not None:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
            continue
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        module.__dict__["_vitserve_packed"] = (weight, packed)  # not a buffer: no state_dict, no .to()
        count += 1
    return count


_PACK_ROWS_HINT = (
    256  # rows (tokens) oneDNN picks the layout for; any row count runs with it (one image's 256)
)


def _routed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is linear_forward or hasattr(type(module), "packs_weight")


def use_onednn_linears(visual: nn.Module) -> int:
    """Route every plain nn.Linear of `visual` through `linear`, in place; returns how many.

    Subclasses keep their forward (TP's RowParallelLinear all-reduces; it calls `linear` itself).
    """
    if not onednn_linear_ok():
        return 0
    count = 0
    for module in visual.modules():
        if type(module) is nn.Linear:
            setattr(module, "forward", types.MethodType(linear_forward, module))  # noqa: B010 (typed method)
            count += 1
    return count
