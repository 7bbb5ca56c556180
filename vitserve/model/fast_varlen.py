"""One varlen attention call per layer on CUDA in bf16/fp16: every window and image of a batch at once.

torch's own variable-length attention (`torch.nn.attention.varlen.varlen_attn`, flash attention's varlen
kernel inside torch; flash-attn's own wheels are too large to carry) takes the packed q, k, v and the
cu_seqlens HF already builds, so a Qwen2.5-VL window layer is one kernel instead of one SDPA call per distinct
segment length (fast_attention.py). It runs only in half precision on CUDA: float32 keeps the exact grouped
SDPA path, and so does the CPU, where no varlen kernel exists.

Whether it runs here is probed once per (device, dtype): a tiny call with an empty segment (the padding of
a CUDA graph's bucket leaves some, vitserve/model/buckets.py) against SDPA per segment. A torch whose API
differs, a kernel that refuses the shape, or one that disagrees leaves every call on the grouped path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)
_PROBE_BOUND = 2e-2  # relative to the output's scale: bf16 has 8 bits of mantissa (4e-3 per rounding)

VarlenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _public_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    out: torch.Tensor = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)  # type: ignore[assignment]
    return out


def _aten_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    # the op varlen_attn calls; present (with this signature) in torch releases whose varlen_attn lacks scale
    out: torch.Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, False, False, scale=scale
    )[0]
    return out


_CANDIDATES: tuple[tuple[str, VarlenFn], ...] = (
    ("torch.nn.attention.varlen.varlen_attn", _public_varlen),
    ("aten._flash_attention_forward", _aten_varlen),
)


@functools.cache
def varlen_kernel(device: torch.device, dtype: torch.dtype) -> VarlenFn | None:
    """The first varlen implementation that runs on (device, dtype) and matches SDPA; None: use SDPA."""
    if device.type != "cuda" or dtype not in HALF:
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [5, 0, 64, 17]  # an empty segment, as bucket padding leaves
    total, heads, head_dim = sum(lengths), 4, 80
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    want = reference_attention(q, k, v, cu.tolist(), scale)
    for name, fn in _CANDIDATES:
        try:
            with torch.inference_mode():
                got = fn(q, k, v, cu, max(lengths), scale)
        except (ImportError, AttributeError, TypeError, RuntimeError) as exc:
            log.info("varlen attention %s unavailable on %s %s: %s", name, device, dtype, exc)
            continue
        err = (got.float() - want.float()).abs().max().item()
        if got.shape == want.shape and err <= _PROBE_BOUND * want.float().abs().max().item():
            log.info("attention: one %s call per layer on %s %s", name, device, dtype)
            return fn
        log.warning(
            "varlen attention %s differs from SDPA by %.3g on %s %s: not used", name, err, device, dtype
        )
    return None


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    """SDPA per segment [bounds[i], bounds[i+1]) of (N, H, D) q, k, v: (N, H, D), empty segments skipped."""
    out = torch.zeros_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor | None:
    """Attention within each cu_seqlens segment in one call, (N, H, D) -> (N, H * D); None where no varlen
    kernel runs on q's device and dtype (the caller then takes the grouped SDPA path)."""
    fn = varlen_kernel(q.device, q.dtype)
    if fn is None:
        return None
    n_tokens = q.shape[0]
    # flash wants each of q, k, v with a contiguous last dim (the qkv split gives that) and int32 offsets
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, max_len, scale).reshape(n_tokens, -1)
