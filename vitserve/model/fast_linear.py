"""Linear layers through oneDNN's matmul on CPU: the same product as F.linear, faster at one image's size.

F.linear on CPU is MKL's sgemm behind torch's addmm, which first copies the bias into every output row and
then accumulates into it; oneDNN (bundled with torch, the kernels torch.compile's CPU backend calls) adds the
bias inside its kernel. On the demo tower, fp32, 2 threads, the whole forward of one 224x224 image went from
0.87-0.95x HF's to 0.80-0.85x, and 4 packed images from 0.91-0.92x to 0.76-0.87x (bench/RESULTS.md, "One image
at a time"). The products differ from MKL's only in summation order: fp32 round-off, like the other fast
forwards (1.3e-6 of the output's scale on the demo tower).

Only where the result is certain to be the same product: CPU, float32, no autograd, a contiguous weight. The
weight stays the module's own Parameter: a oneDNN-packed copy was a further ~4% faster at batch 1 but doubles
the weights' memory. A probe the first time compares the op with F.linear; when oneDNN is missing (a build
without it) or disagrees, every call stays F.linear.
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); through oneDNN when on CPU in fp32 without autograd (see the module doc)."""
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
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through `linear`."""
    return linear(x, self.weight, self.bias)


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
