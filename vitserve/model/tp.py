"""Tensor parallelism as a separate pass over an unchanged Hugging Face vision tower (gpt-fast `tp.py` style).

`apply_tp(visual, family)` walks the tower's transformer blocks (a module with an `attn`/`attention` child and
an `mlp` child) and shards them in place, Megatron style, so each block needs exactly two all-reduces:

- attention: q, k and v column-parallel BY HEAD (rank r keeps heads [r*h/tp, (r+1)*h/tp) of each of q, k and
  v — the fused Qwen `qkv` [3*dim, dim] is viewed as (3, heads, head_dim, dim) so the split never mixes q with
  k); the output projection (`proj` / `projection_layer`) row-parallel. `num_heads` (and InternVL's
  `embed_dim`, used to reshape the attention output) are set to the local values: HF's forwards and the
  fast kernels read them at forward time.
- MLP: `fc1` / `gate_proj` / `up_proj` / `linear_fc1` column-parallel, `fc2` / `down_proj` / `linear_fc2`
  row-parallel.
- row-parallel layers compute `F.linear(x, w_shard)`, all-reduce (SUM), then add the bias ONCE.

Replicated on every rank: patch embedding, position embeddings, rotary, norms, the merger / deepstack
mergers / InternVL projector. The merger runs on a quarter of the tokens and is a small share of the FLOPs;
keeping it whole keeps this pass to the blocks and their two all-reduces.

InternVL with `use_qk_norm`: its q/k RMSNorm normalises over the FULL embedding (all heads together), so a
rank cannot compute it from its own heads. We implement it exactly: each rank sums the squares of its
slice in fp32, one all-reduce (SUM) gives the full sum, and the rank scales its slice with its slice of the
norm weight (two extra small all-reduces of shape (..., 1) per block).

Inputs are identical on every rank (rank 0 broadcasts the batch) and every output is replicated, so the
engine reads the embedding from any rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from vitserve.errors import ConfigError
from vitserve.families import FAMILIES
from vitserve.model.fast_linear import linear, packed_weight

_ATTENTION_NAMES = ("attn", "attention")
_MLP_COLUMN = ("fc1", "gate_proj", "up_proj", "linear_fc1")
_MLP_ROW = ("fc2", "down_proj", "linear_fc2")
_ATTN_ROW = ("proj", "projection_layer")


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x @ w_shard^T) + b: the input's last dim is this rank's slice, the output is whole.

    A subclass of nn.Linear (same `weight` / `bias` names and shapes conventions) so code that recognises
    linear layers by type, e.g. vitserve.model.fast's attention check, still does after this pass.
    """

    packs_weight = True  # its forward runs vitserve.model.fast_linear.linear: pack_linear_weights may pack it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup | None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a fresh (out, in) weight
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in / tp)
        # (out,), not sharded; register_parameter accepts None like nn.Linear(bias=False) does
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.group = group
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, packed=packed_weight(self))  # (..., out): this rank's partial sum
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        if self.bias is not None:
            y = y + self.bias  # once, after the sum (adding it per rank would count it tp times)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (shard), out_features={self.out_features}, bias={self.bias is not None}"


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dim split across ranks (InternVL q/k norm): exact, via one all-reduce of x^2 sums."""

    def __init__(self, weight: torch.Tensor, eps: float, full_dim: int, group: ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (full_dim / tp,)
        self.variance_epsilon = eps
        self.full_dim = full_dim
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)  # (..., full_dim / tp)
        sq = x32.pow(2).sum(-1, keepdim=True)  # (..., 1)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        x32 = x32 * torch.rsqrt(sq / self.full_dim + self.variance_epsilon)
        return self.weight * x32.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------------


def apply_tp(visual: nn.Module, family: str, group: ProcessGroup | None = None) -> nn.Module:
    """Shard `visual` in place for this rank of `group` (default: the default process group)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if getattr(visual, "_vitserve_tp", None) is not None:
        raise ConfigError(
            f"apply_tp was already applied to this tower ({visual._vitserve_tp}); shard it once"
        )
    blocks = find_blocks(visual)
    if not blocks:
        name = FAMILIES[family].display if family in FAMILIES else family
        raise ConfigError(f"{name}: found no transformer blocks to shard; run with --tp 1")
    # --tp must divide the heads and widths: preflight.check_tp refuses any other before a rank starts
    if world == 1:
        return visual
    for block in blocks:
        _shard_attention(_attention_of(block), rank, world, group)
        _shard_mlp(block._modules["mlp"], rank, world, group)
    visual.__dict__["_vitserve_tp"] = f"rank {rank} of {world}"  # a second pass would shard the shards
    return visual


def find_blocks(visual: nn.Module) -> list[nn.Module]:
    """Transformer blocks: modules with an attention child and an `mlp` child (mergers have no attention)."""
    return [m for m in visual.modules() if "mlp" in m._modules and _attention_of(m) is not None]


def _attention_of(block: nn.Module) -> Any:
    for name in _ATTENTION_NAMES:
        attn = block._modules.get(name)
        if attn is not None and hasattr(attn, "num_heads"):
            return attn
    return None


def _shard_attention(attn: Any, rank: int, world: int, group: ProcessGroup | None) -> None:
    heads = int(attn.num_heads)
    local = heads // world
    lo, hi = rank * local, (rank + 1) * local
    if "qkv" in attn._modules:
        _column_by_head(attn.qkv, lo, hi, heads, fused=3)
    else:  # InternVL: separate q/k/v
        for proj in ("q_proj", "k_proj", "v_proj"):
            _column_by_head(getattr(attn, proj), lo, hi, heads, fused=1)
        _shard_qk_norms(attn, lo, hi, heads, group)
        attn.embed_dim = local * attn.head_dim  # HF reshapes the attention output with it
    for row in _ATTN_ROW:
        if row in attn._modules:
            setattr(attn, row, _row_parallel(getattr(attn, row), rank, world, group))
    attn.num_heads = local


def _shard_mlp(mlp: Any, rank: int, world: int, group: ProcessGroup | None) -> None:
    for col in _MLP_COLUMN:
        if col in mlp._modules:
            _column_by_head(getattr(mlp, col), rank, rank + 1, world, fused=1)  # `world` equal chunks
    for row in _MLP_ROW:
        if row in mlp._modules:
            setattr(mlp, row, _row_parallel(getattr(mlp, row), rank, world, group))


def _column_by_head(linear: nn.Linear, lo: int, hi: int, chunks: int, *, fused: int) -> None:
    """Keep output rows of chunks [lo, hi) from each of the `fused` stacked projections (q, k, v)."""
    out, dim = linear.weight.shape
    w = linear.weight.detach().view(fused, chunks, out // (fused * chunks), dim)  # (3, heads, head_dim, dim)
    linear.weight = nn.Parameter(_own(w[:, lo:hi].reshape(-1, dim)), requires_grad=False)
    if linear.bias is not None:
        b = linear.bias.detach().view(fused, chunks, -1)  # (3, heads, head_dim)
        linear.bias = nn.Parameter(_own(b[:, lo:hi].reshape(-1)), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, rank: int, world: int, group: ProcessGroup | None) -> RowParallelLinear:
    out, width = linear.weight.shape
    local = width // world
    w = linear.weight.detach()[:, rank * local : (rank + 1) * local]  # (out, width / tp)
    bias = None if linear.bias is None else _own(linear.bias.detach())
    return RowParallelLinear(_own(w), bias, group)


def _shard_qk_norms(attn: Any, lo: int, hi: int, heads: int, group: ProcessGroup | None) -> None:
    for name in ("q_norm", "k_norm"):
        norm: Any = attn._modules.get(name)
        if norm is None or getattr(norm, "weight", None) is None:
            continue  # nn.Identity when use_qk_norm is off
        if getattr(norm, "bias", None) is not None:
            raise ConfigError(
                f"{name} of {type(attn).__name__} is not an RMSNorm; only RMS q/k norms shard; use --tp 1"
            )
        full = norm.weight.shape[0]
        per_head = full // heads
        weight = _own(norm.weight.detach()[lo * per_head : hi * per_head])  # (local_heads * head_dim,)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        setattr(attn, name, ShardedRMSNorm(weight, eps, full, group))


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, so the shard does not keep the full tensor's storage alive."""
    return t.clone(memory_format=torch.contiguous_format)
