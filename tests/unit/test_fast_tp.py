"""The optimized attention under a simulated tensor-parallel shard (what vitserve/model/tp.py does).

TP keeps the modules, slices qkv by heads (column parallel) and proj by input columns (row parallel),
sets `num_heads` to the local count, and all-reduces proj's output. Summing the shards' outputs here
stands in for the all-reduce; it must equal the unsharded output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.unit.test_fast import assert_close, make_tower
from vitserve.model.fast import optimize


def _shard_attention(attn: nn.Module, rank: int, world: int) -> nn.Module:
    shard = copy.deepcopy(attn)  # deepcopy rebinds the patched forward to the copy
    heads, dim = attn.num_heads, attn.proj.in_features
    head_dim = dim // heads
    local = heads // world
    cols = torch.arange(rank * local * head_dim, (rank + 1) * local * head_dim)  # this rank's head columns
    rows = torch.cat([cols + part * dim for part in range(3)])  # its q, k and v rows of qkv
    with torch.no_grad():
        shard.qkv = nn.Linear(dim, rows.numel())
        shard.qkv.weight.copy_(attn.qkv.weight[rows])
        shard.qkv.bias.copy_(attn.qkv.bias[rows])
        shard.proj = nn.Linear(cols.numel(), attn.proj.out_features)
        shard.proj.weight.copy_(attn.proj.weight[:, cols])
        shard.proj.bias.copy_(attn.proj.bias if rank == 0 else torch.zeros_like(attn.proj.bias))
    shard.num_heads = local  # what apply_tp sets; the forward must read it, not a cached count
    return shard


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("block", [0, 1])  # qwen2_5_vl: 0 is a window block, 1 a full-attention block
def test_sharded_attention_sums_to_full(family, block):
    tower = optimize(make_tower(family), family)
    attn = tower.blocks[block].attn
    gen = torch.Generator().manual_seed(3)
    n_tokens, head_dim = 100, attn.proj.in_features // attn.num_heads
    hidden = torch.randn(n_tokens, attn.proj.in_features, generator=gen)  # (N, E)
    theta = torch.rand(n_tokens, head_dim, generator=gen) * 6.0  # (N, D) rotary angles
    cu_seqlens = torch.tensor([0, 16, 32, 60, 76, 100], dtype=torch.int32)  # equal and unequal segments
    args = {"cu_seqlens": cu_seqlens, "position_embeddings": (theta.cos(), theta.sin())}
    with torch.inference_mode():
        full = attn(hidden, **args)
        sharded = sum(_shard_attention(attn, rank, 2)(hidden, **args) for rank in range(2))
    assert_close(sharded, full)


def test_head_count_is_read_at_forward_time():
    tower = optimize(make_tower("qwen2_5_vl"), "qwen2_5_vl")
    attn = tower.blocks[0].attn
    hidden = torch.randn(16, attn.proj.in_features)
    theta = torch.rand(16, attn.proj.in_features // attn.num_heads)
    args = {
        "cu_seqlens": torch.tensor([0, 16], dtype=torch.int32),
        "position_embeddings": (theta.cos(), theta.sin()),
    }
    attn.num_heads = 3  # 64 columns do not split into 3 heads: the forward must notice
    with torch.inference_mode(), pytest.raises(RuntimeError):
        attn(hidden, **args)
