"""One varlen attention call per layer on CUDA in bf16/fp16: every window and image of a batch at once.

torch's own variable-length attention (`torch.nn.attention.varlen.varlen_attn`, flash attention's varlen
kernel inside torch; flash-attn's own wheels are too large to carry) takes the packed q, k, v and the
cu_seqlens HF already builds, so a Qwen2.5-VL window layer is one kernel instead of one SDPA call per distinct
segment length (fast_attention.py). It runs only in half precision on CUDA: float32 keeps the exact grouped
SDPA path, and so does the CPU, where no varlen kernel exists.

Whether it runs here is probed once per (device, dtype, heads, head_dim): a tiny call in the real calls'
strided layout with an empty segment (the padding of a CUDA graph's bucket leaves some,
vitserve/model/buckets.py) against SDPA per segment. A torch whose API differs, a kernel that refuses the
shape, or one that disagrees is skipped for the next; with none, every call takes the grouped path. A kernel
that fails on a real call falls back the same way, with a WARNING. `kernels_ran` counts which one served.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)
_PROBE_BOUND = 2e-2  # relative to the output's scale: bf16 has 8 bits of mantissa (4e-3 per rounding)

GROUPED = "grouped SDPA"  # fast_attention.packed_attention, where no varlen kernel serves
_RAN: Counter[str] = Counter()

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
def probed_kernels(
    device: torch.device, dtype: torch.dtype, heads: int, head_dim: int
) -> list[tuple[str, VarlenFn]]:
    """The varlen implementations that run on (device, dtype, heads, head_dim) and match SDPA, in order of
    preference (empty: use SDPA). The probe passes what a real call passes: q and k as views of one
    (N, 2, H, D) tensor (the rotary's output), v a view of the (N, 3, H, D) qkv projection, so strided, at
    the tower's own head_dim (80 for Qwen2.5-VL-7B, 72 for Qwen3-VL-8B)."""
    if device.type != "cuda" or dtype not in HALF:
        return []
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [5, 0, 64, 17]  # an empty segment, as bucket padding leaves
    total = sum(lengths)
    qkv = torch.randn(total, 3, heads, head_dim, generator=gen).to(device, dtype)
    qk = qkv[:, :2].float().to(dtype)  # a fresh (N, 2, H, D) tensor, as apply_rotary returns
    q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    want = reference_attention(q, k, v, cu.tolist(), scale)
    found = []
    where = f"on {device} {dtype}, {heads} heads of {head_dim}"
    for name, fn in _CANDIDATES:
        try:
            with torch.inference_mode():
                got = fn(q, k, v, cu, max(lengths), scale)
        except (ImportError, AttributeError, TypeError, RuntimeError, NotImplementedError) as exc:
            log.info("varlen attention %s does not run %s: %s", name, where, exc)
            continue
        err = (got.float() - want.float()).abs().max().item()
        if got.shape == want.shape and err <= _PROBE_BOUND * want.float().abs().max().item():
            found.append((name, fn))
        else:
            log.warning("varlen attention %s differs from SDPA by %.3g %s: not used", name, err, where)
    if found:
        log.info("attention %s: one %s call per layer", where, found[0][0])
    else:
        log.warning("attention %s: no varlen kernel runs, %s (no CUDA graphs)", where, GROUPED)
    return found


def varlen_kernel(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> VarlenFn | None:
    """The preferred varlen implementation that runs here (probed_kernels), or None: use SDPA."""
    kernels = probed_kernels(device, dtype, heads, head_dim)
    return kernels[0][1] if kernels else None


def kernels_ran() -> dict[str, int]:
    """How many attention calls each kernel served since the last reset_kernels_ran (GROUPED: fast.py's
    grouped SDPA path, counted there by count_grouped). Captured graphs replay without counting."""
    return dict(_RAN)


def reset_kernels_ran() -> None:
    _RAN.clear()


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
    kernel runs on q's device, dtype and shape (the caller then takes the grouped SDPA path).

    A kernel that passed the probe but raises on a real call is dropped for that shape with a WARNING, and
    the next one (or the grouped path) serves this call and the following ones."""
    n_tokens, heads, head_dim = q.shape
    # flash wants each of q, k, v with a contiguous last dim (the qkv split gives that) and int32 offsets
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return first_that_runs(probed_kernels(q.device, q.dtype, heads, head_dim), q, k, v, cu, max_len, scale)


def first_that_runs(
    kernels: list[tuple[str, VarlenFn]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor | None:
    """The first of `kernels` that runs this call, (N, H * D); one that raises is removed from the list (the
    probe's cached list: later calls skip it) with a WARNING naming what serves instead. None: none ran."""
    while kernels:
        name, fn = kernels[0]
        try:
            out = fn(q, k, v, cu, max_len, scale).reshape(q.shape[0], -1)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            kernels.pop(0)
            after = kernels[0][0] if kernels else GROUPED
            log.warning(
                "varlen attention %s failed on %d rows (%s): falling back to %s", name, q.shape[0], exc, after
            )
            continue
        _RAN[name] += 1
        return out
    return None


def count_grouped() -> None:
    """One attention call served by the grouped SDPA path (fast.py, where no varlen kernel ran it)."""
    _RAN[GROUPED] += 1
