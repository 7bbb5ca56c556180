"""The per-grid set-up of a windowed Qwen tower's forward, made once per grid instead of once per forward.

HF's Qwen2.5-VL tower rebuilds from grid_thw, on every forward, the rotary position ids, the attention
cu_seqlens and the window index of its batch (transformers.vision_utils: a Python loop over the images,
dozens of small tensor ops). transformers accepts them precomputed as keyword arguments of the tower's
forward (each `get_vision_*` helper pops its key), so the adapter passes the ones made here, from the same
helpers with the same arguments: the forward's math and output are unchanged.

A client sending images of one size pays that set-up on every request (bench/RESULTS.md, "One image at a
time"); here a batch whose grids were seen recently reuses it. The same cu_seqlens tensors also make
vitserve.model.fast's attention plans (keyed by their identity) hit across forwards. Only small batches are
kept (a large batch's forward dwarfs its set-up), so the cache stays a few MiB at most.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

SETUP_SLOTS = 32  # distinct recent batches' set-ups kept per tower
MAX_CACHED_PATCHES = 4096  # batches above this many patches compute their set-up in the forward, as HF does


class GridSetups:
    """Precomputed forward keyword arguments of one windowed Qwen tower, keyed by the batch's grids."""

    def __init__(self, slots: int = SETUP_SLOTS, max_patches: int = MAX_CACHED_PATCHES) -> None:
        self._slots = slots
        self._max_patches = max_patches
        self._entries: OrderedDict[tuple[object, ...], dict[str, torch.Tensor]] = OrderedDict()

    def kwargs(self, visual: nn.Module, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keyword arguments for `visual(pixel_values, grid_thw=grid_thw, **kwargs)`; a fresh dict."""
        grids = tuple(tuple(g) for g in grid_thw.tolist())
        if sum(t * h * w for t, h, w in grids) > self._max_patches:
            return {}
        key = (grid_thw.device, grids)
        entry = self._entries.get(key)
        if entry is None:
            entry = window_setup(visual, grid_thw)
            self._entries[key] = entry
            if len(self._entries) > self._slots:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return dict(entry)  # the forward pops from its own kwargs dict, never from ours


def window_setup(visual: Any, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """What Qwen2.5-VL's tower forward computes from grid_thw before its first block, by the same helpers."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    merge = int(visual.spatial_merge_size)  # plain ints on HF's tower (config values)
    window_index, cu_window_seqlens = get_vision_window_index(
        grid_thw,
        spatial_merge_size=merge,
        window_size=int(visual.window_size),
        patch_size=int(visual.patch_size),
    )
    return {
        "position_ids": get_vision_position_ids(grid_thw, merge),
        "cu_seqlens": get_vision_cu_seqlens(grid_thw),
        "window_index": window_index,
        "cu_window_seqlens": cu_window_seqlens,
    }


def grid_setups(visual: nn.Module) -> GridSetups:
    """The tower's own cache, made on first use (a tower built without vitserve's loader gets one too)."""
    setups = getattr(visual, "_vitserve_grid_setups", None)
    if setups is None:
        setups = GridSetups()
        setattr(visual, "_vitserve_grid_setups", setups)  # noqa: B010 (nn.Module's typed __setattr__)
    return setups
