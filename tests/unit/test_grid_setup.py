"""vitserve.model.grid_setup: the Qwen2.5-VL tower's per-grid set-up, made once and passed precomputed."""

from __future__ import annotations

import copy

import torch

from tests.unit.test_fast import GRIDS, make_tower
from vitserve.model.adapters import ADAPTERS
from vitserve.model.fast import optimize
from vitserve.model.grid_setup import GridSetups, grid_setups


def _packed_inputs(
    tower: torch.nn.Module, grids: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = tower.config
    grid_thw = torch.tensor(grids)  # (B, 3)
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(
        int(grid_thw.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(1)
    ), grid_thw


def test_precomputed_setup_gives_hf_output_bit_for_bit():
    """The same helpers with the same arguments: HF's forward computes the same tensors, so the same output."""
    tower = make_tower("qwen2_5_vl")
    forward = ADAPTERS["qwen2_5_vl"].forward
    with torch.inference_mode():
        for grids in (
            GRIDS["single"],
            GRIDS["mixed"],
            [(2, 8, 12)],
        ):  # one image, mixed sizes, a 2-frame video
            pixels, grid_thw = _packed_inputs(tower, grids)
            want = tower(pixels, grid_thw=grid_thw).pooler_output
            for _ in range(2):  # the first call fills the cache, the second reads it
                got, deepstack = forward(tower, pixels, grid_thw)
                assert torch.equal(got, want)
                assert deepstack == []


def test_optimized_tower_reuses_setup_and_attention_plans():
    """A repeated grid reuses the same cu_seqlens tensors, so fast.py's plans are not rebuilt either."""
    tower = optimize(copy.deepcopy(make_tower("qwen2_5_vl")), "qwen2_5_vl")
    pixels, grid_thw = _packed_inputs(tower, GRIDS["mixed"])
    forward = ADAPTERS["qwen2_5_vl"].forward
    with torch.inference_mode():
        forward(tower, pixels, grid_thw)
        first = grid_setups(tower).kwargs(tower, grid_thw)
        again = grid_setups(tower).kwargs(tower, grid_thw.clone())
    assert again is not first  # a fresh dict each time: the forward pops from it
    assert set(first) == {"position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"}
    assert all(again[k] is first[k] for k in first)


def test_cache_is_bounded_and_skips_large_batches():
    tower = make_tower("qwen2_5_vl")
    setups = GridSetups(slots=2, max_patches=200)
    a, b, c = (torch.tensor([g]) for g in ((1, 8, 8), (1, 8, 12), (1, 12, 12)))
    first_a = setups.kwargs(tower, a)["cu_seqlens"]
    setups.kwargs(tower, b)
    setups.kwargs(tower, c)  # evicts a, the least recently used
    assert setups.kwargs(tower, a)["cu_seqlens"] is not first_a
    assert setups.kwargs(tower, torch.tensor([(1, 16, 16)])) == {}  # 256 patches > 200: HF computes it
