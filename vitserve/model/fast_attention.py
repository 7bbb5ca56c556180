"""Packed variable-length attention without a per-segment Python loop.

HF's SDPA path splits the packed sequence at every cu_seqlens boundary and calls SDPA once per segment: a
Qwen2.5-VL window layer over one large image is hundreds of tiny calls. Segments of equal length (all full
windows, all images of the same size) are one batched SDPA call here; only the distinct lengths loop.
The result is the same math as HF's (softmax(q k^T * scale) v per segment), so it is exact to fp32 round-off.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Group:
    """All segments of one length: `count` of them, `length` tokens each."""

    length: int
    count: int
    start: int  # first token when the segments are back to back (a plain slice); -1 otherwise
    index: torch.Tensor | None  # (count * length,) token indices when they are not back to back


@dataclass(frozen=True)
class AttentionPlan:
    """How to run one packed attention: the groups of equal-length segments, in first-seen order."""

    total: int  # tokens in the packed sequence
    groups: tuple[_Group, ...]

    @property
    def max_length(self) -> int:
        """The longest segment (0 for none): a varlen kernel's max_seqlen."""
        return max((g.length for g in self.groups), default=0)


def build_plan(cu_seqlens: torch.Tensor) -> AttentionPlan:
    """Group the segments of `cu_seqlens` ((S+1,) int, cumulative) by length."""
    bounds = cu_seqlens.tolist()
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:  # HF drops nothing, but an empty segment contributes nothing either
            starts_by_length.setdefault(end - start, []).append(start)
    groups = tuple(
        _make_group(length, starts, cu_seqlens.device) for length, starts in starts_by_length.items()
    )
    return AttentionPlan(total=bounds[-1] - bounds[0], groups=groups)


def _make_group(length: int, starts: list[int], device: torch.device) -> _Group:
    back_to_back = all(b - a == length for a, b in zip(starts[:-1], starts[1:], strict=True))
    if back_to_back:
        return _Group(length, len(starts), starts[0], None)
    begin = torch.tensor(starts, dtype=torch.long, device=device)  # (count,)
    index = (begin[:, None] + torch.arange(length, device=device)).reshape(-1)  # (count * length,)
    return _Group(length, len(starts), -1, index)


class PlanCache:
    """Plans keyed by the identity of the cu_seqlens tensor, shared by all layers of one tower.

    HF builds cu_seqlens once per forward and hands the same tensor to every block, so the plan (and its
    device->host sync on CUDA) is made once per forward and kind (window / full), not once per layer.
    Weak references: a freed cu_seqlens can never alias a new one with a stale plan.
    """

    def __init__(self, slots: int = 4) -> None:
        self._slots = slots
        self._entries: list[tuple[weakref.ref[torch.Tensor], AttentionPlan]] = []

    def get(self, cu_seqlens: torch.Tensor) -> AttentionPlan:
        for ref, plan in self._entries:
            if ref() is cu_seqlens:
                return plan
        plan = build_plan(cu_seqlens)
        self._entries = [(r, p) for r, p in self._entries if r() is not None][-(self._slots - 1) :]
        self._entries.append((weakref.ref(cu_seqlens), plan))
        return plan


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Attention within each segment. q, k, v: (N, H, D), any strides with a contiguous last dim.

    Returns (N, H * D), contiguous.
    """
    n_tokens, heads, head_dim = q.shape
    if len(plan.groups) == 1 and plan.groups[0].index is None:
        return _group_attention(q, k, v, plan.groups[0].count, plan.groups[0].length, scale)
    out = q.new_empty(n_tokens, heads * head_dim)  # (N, H*D)
    for group in plan.groups:
        if group.index is None:
            rows = slice(group.start, group.start + group.count * group.length)
            out[rows] = _group_attention(q[rows], k[rows], v[rows], group.count, group.length, scale)
        else:
            qg, kg, vg = (t.index_select(0, group.index) for t in (q, k, v))  # (count*L, H, D)
            out.index_copy_(0, group.index, _group_attention(qg, kg, vg, group.count, group.length, scale))
    return out


def _group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, length: int, scale: float
) -> torch.Tensor:
    """`count` independent segments of `length` tokens, back to back: (count*L, H, D) -> (count*L, H*D)."""
    heads, head_dim = q.shape[1], q.shape[2]

    def batched(t: torch.Tensor) -> torch.Tensor:
        return torch.unflatten(t, 0, (count, length)).transpose(1, 2)  # (count, H, L, D), a view

    o = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=scale)  # (count, H, L, D)
    return o.transpose(1, 2).reshape(count * length, heads * head_dim)  # a view when SDPA wrote (B, L, H, D)
