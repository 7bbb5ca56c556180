"""A Qwen tower's forward split for CUDA graphs: an eager stem, a fixed-shape body, an eager tail.

HF's Qwen vision forward (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with DeepStack, Qwen3.5) is, in order: per-grid
set-up from grid_thw (position ids, cu_seqlens, window index, interpolation indices: host-side loops), the
patch embedding (+ the interpolated position embedding, Qwen3), the window permutation (Qwen2.5), the rotary
cos/sin, the blocks (DeepStack mergers after some, Qwen3-VL), the merger, the inverse permutation. Here:
  * stem: everything up to the blocks, eager, with HF's own helpers and submodules (same math);
  * body: the blocks and mergers on (rows, width) hidden states, given cos/sin, the attention offsets as
    device tensors and each kind of layer's max segment length as a plain int: no host sync, so on CUDA it
    can be captured in a graph per `buckets.GraphKey` and replayed;
  * tail: the padding cut, the inverse permutation.
A batch pads up to its bucket (buckets.py): zero rows in segments of their own, never attended by a real row,
cut from the output. The real rows equal the unpadded forward's to float round-off (tests/unit/
test_tower_graphs.py). A batch no captured graph holds runs the same body eagerly, unpadded.

Graphs share one memory pool, captured largest first so the smaller ones reuse its blocks; inputs are static
buffers per bucket; every warm-up and capture runs on one side stream. `capture` returns the bytes the
graphs hold (cached blocks released before it reads), which the rank adds to the reservation it publishes.
`compile_blocks` runs each block through torch.compile (CUDA: fuses the rotary, norm, activation and
residual elementwise kernels); it is off unless asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitserve.model.buckets import (
    DEFAULT_BUCKETS,
    DEFAULT_IMAGE_LADDER,
    GraphKey,
    fill_slots,
    ladder_keys,
    pad_bounds,
    pick_key,
)
from vitserve.model.fast_varlen import varlen_kernel

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # merged rows, DeepStack levels


@dataclass
class Prepared:
    """A batch after the stem: what the body takes, unpadded, and what the tail needs."""

    hidden: torch.Tensor  # (rows, width), in window order for Qwen2.5
    cos: torch.Tensor  # (rows, head_dim) float32
    sin: torch.Tensor
    full_bounds: list[int]  # cumulative offsets of the full-attention segments (images)
    window_bounds: list[int] | None  # of the window segments; None without window layers
    window_index: torch.Tensor | None  # Qwen2.5's permutation of merge units

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    cu_full: torch.Tensor
    cu_window: torch.Tensor | None
    merged: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


def supports(visual: nn.Module) -> bool:
    """A Qwen tower this runner knows: blocks, a merger, patch_embed and 2-D rotary."""
    return all(hasattr(visual, name) for name in ("blocks", "merger", "patch_embed", "rotary_pos_emb"))


class TowerRunner:
    """Runs one Qwen tower by stem / body / tail; padded into captured CUDA graphs where one fits."""

    def __init__(
        self,
        visual: nn.Module,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        image_ladder: Sequence[int] = DEFAULT_IMAGE_LADDER,
        compile_blocks: bool = False,
    ) -> None:
        if not supports(visual):
            raise ValueError(f"TowerRunner: {type(visual).__name__} is not a Qwen vision tower")
        self.visual = visual
        v: Any = visual
        self.merge_unit = int(v.spatial_merge_size) ** 2
        if any(b % self.merge_unit for b in buckets):
            raise ValueError(f"TowerRunner: buckets {list(buckets)} must be multiples of {self.merge_unit}")
        self.windowed = hasattr(v, "fullatt_block_indexes")
        depth = len(v.blocks)
        self.full_layers = set(v.fullatt_block_indexes) if self.windowed else set(range(depth))
        self.deepstack = list(getattr(v, "deepstack_visual_indexes", None) or [])
        self.window_rows = 0
        if self.windowed:
            side = int(v.window_size) // int(v.spatial_merge_size) // int(v.patch_size)
            self.window_rows = side * side * self.merge_unit
        self.keys = ladder_keys(buckets, image_ladder, self.window_rows or None)
        self.graphs: dict[GraphKey, _Captured] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._call_block: Callable[..., torch.Tensor] = _call_block
        if compile_blocks and next(visual.parameters()).device.type != "cuda":
            # the CPU's linear layers run oneDNN ops (fast_linear.py) that inductor cannot lower
            raise ValueError("TowerRunner: compile_blocks is for a CUDA tower")
        if compile_blocks:  # shapes that vary (rows, slots) turn dynamic after the first recompile
            import torch._dynamo

            limit = torch._dynamo.config.cache_size_limit
            torch._dynamo.config.cache_size_limit = max(limit, 4 * len(self.keys))
            self._call_block = torch.compile(_call_block)

    # ---- the three parts -------------------------------------------------------------------------------
    def stem(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> Prepared:
        """HF's forward up to the first block, with HF's helpers (vitserve/model/grid_setup.py for Qwen2.5)."""
        v: Any = self.visual
        position_ids, cu_full, window_index, cu_window = self._setup(grid_thw)
        hidden = v.patch_embed(pixels)  # (rows, width)
        if hasattr(v, "pos_embed"):  # Qwen3-VL / Qwen3.5: the learned grid, interpolated per image
            hidden = hidden + self._pos_embeds(grid_thw).to(hidden.dtype)
        rows = hidden.shape[0]
        cos, sin = v.rotary_pos_emb(hidden, position_ids)
        if window_index is not None:
            hidden = v.permute_input_for_window_attn(hidden, window_index, seq_len=rows)
            cos = v.permute_input_for_window_attn(cos, window_index, seq_len=rows)
            sin = v.permute_input_for_window_attn(sin, window_index, seq_len=rows)
        return Prepared(
            hidden=hidden,
            cos=cos,
            sin=sin,
            full_bounds=[int(x) for x in cu_full.tolist()],
            window_bounds=None if cu_window is None else [int(x) for x in cu_window.tolist()],
            window_index=window_index,
        )

    def _setup(self, grid_thw: torch.Tensor) -> tuple[Any, torch.Tensor, Any, Any]:
        """(position ids, full offsets, window index, window offsets) of a batch: host-side, from grid_thw."""
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

        v: Any = self.visual
        if self.windowed:
            from vitserve.model.grid_setup import grid_setups, window_setup

            setup = grid_setups(v).kwargs(v, grid_thw) or window_setup(v, grid_thw)
            return (
                setup["position_ids"],
                setup["cu_seqlens"],
                setup["window_index"],
                setup["cu_window_seqlens"],
            )
        return (
            get_vision_position_ids(grid_thw, int(v.spatial_merge_size)),
            get_vision_cu_seqlens(grid_thw),
            None,
            None,
        )

    def _pos_embeds(self, grid_thw: torch.Tensor) -> torch.Tensor:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        v: Any = self.visual
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=v.num_grid_per_side,
            mode=v.interpolation_mode,
            align_corners=v.interpolation_align_corners,
            spatial_merge_size=v.config.spatial_merge_size,
        )
        pos: torch.Tensor = (v.pos_embed(indices) * weights[:, :, None]).sum(1)
        return pos

    def body(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_full: torch.Tensor,
        cu_window: torch.Tensor | None,
        max_full: int,
        max_window: int,
    ) -> Outputs:
        """The blocks (DeepStack mergers after theirs) and the merger; capturable (no host sync)."""
        v: Any = self.visual
        levels: list[torch.Tensor] = []
        for i, blk in enumerate(v.blocks):
            full = i in self.full_layers or cu_window is None
            cu, max_len = (cu_full, max_full) if full else (cu_window, max_window)
            hidden = self._call_block(blk, hidden, cu, max_len, cos, sin)
            if i in self.deepstack:
                levels.append(v.deepstack_merger_list[self.deepstack.index(i)](hidden))
        merged: torch.Tensor = v.merger(hidden)
        return merged, levels

    def tail(self, prep: Prepared, merged: torch.Tensor, levels: list[torch.Tensor]) -> Outputs:
        """Cut the padding and undo the window permutation; fresh tensors (a graph's outputs are reused)."""
        units = prep.rows // self.merge_unit
        merged, levels = merged[:units], [level[:units] for level in levels]
        if prep.window_index is not None:
            reverse = torch.argsort(prep.window_index)
            return merged[reverse], [level[reverse] for level in levels]
        return merged.clone(), [level.clone() for level in levels]

    # ---- running a batch -------------------------------------------------------------------------------
    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor, *, pad_eagerly: bool = False) -> Outputs:
        """The tower's (merged rows, DeepStack levels). In a captured graph when one holds the batch; with
        pad_eagerly (tests, CPU) padded the same way but run eagerly; else eagerly, unpadded."""
        prep = self.stem(pixels, grid_thw)
        key = self.key_for(prep, self.graphs if self.graphs else (self.keys if pad_eagerly else []))
        if key is None:
            return self.tail(prep, *self.run_unpadded(prep))
        return self.tail(prep, *self.run_padded(prep, key))

    def key_for(self, prep: Prepared, keys: Sequence[GraphKey] | dict[GraphKey, Any]) -> GraphKey | None:
        windows = 0 if prep.window_bounds is None else len(prep.window_bounds) - 1
        chunk = self.window_rows or 1
        return pick_key(keys, prep.rows, len(prep.full_bounds) - 1, windows, chunk)

    def key_for_grid(
        self, grid_thw: torch.Tensor, keys: Sequence[GraphKey] | dict[GraphKey, Any]
    ) -> GraphKey | None:
        """key_for a batch of these images, from the stem's own offsets (no pixels, no forward)."""
        _, cu_full, _, cu_window = self._setup(grid_thw)
        windows = 0 if cu_window is None else len(cu_window) - 1
        rows = int(grid_thw.prod(-1).sum())
        return pick_key(keys, rows, len(cu_full) - 1, windows, self.window_rows or 1)

    def run_unpadded(self, prep: Prepared) -> Outputs:
        device = prep.hidden.device
        cu_full = torch.tensor(prep.full_bounds, dtype=torch.int32, device=device)
        cu_window = max_window = None
        if prep.window_bounds is not None:
            cu_window = torch.tensor(prep.window_bounds, dtype=torch.int32, device=device)
            max_window = _max_len(prep.window_bounds)
        return self.body(
            prep.hidden, prep.cos, prep.sin, cu_full, cu_window, _max_len(prep.full_bounds), max_window or 0
        )

    def padded_offsets(self, prep: Prepared, key: GraphKey) -> tuple[list[int], list[int] | None]:
        """The full and window offsets of `prep` padded to key.bucket rows, filled to the key's slots."""
        full = fill_slots(pad_bounds(prep.full_bounds, key.bucket, key.bucket), key.full_slots)
        window = None
        if prep.window_bounds is not None:
            window = fill_slots(
                pad_bounds(prep.window_bounds, key.bucket, self.window_rows), key.window_slots
            )
        return full, window

    def run_padded(self, prep: Prepared, key: GraphKey) -> Outputs:
        full, window = self.padded_offsets(prep, key)
        captured = self.graphs.get(key)
        if captured is None:  # the same padding, run eagerly (CPU, tests)
            hidden, cos, sin = (_pad_rows(t, key.bucket) for t in (prep.hidden, prep.cos, prep.sin))
            device = hidden.device
            cu_full = torch.tensor(full, dtype=torch.int32, device=device)
            cu_window = None if window is None else torch.tensor(window, dtype=torch.int32, device=device)
            return self.body(hidden, cos, sin, cu_full, cu_window, key.bucket, self.window_rows)
        hidden_buf, cos_buf, sin_buf = self._inputs[key.bucket]
        rows = prep.rows
        for buf, src in ((hidden_buf, prep.hidden), (cos_buf, prep.cos), (sin_buf, prep.sin)):
            buf[:rows].copy_(src)
            buf[rows:].zero_()
        captured.cu_full.copy_(torch.tensor(full, dtype=torch.int32), non_blocking=True)
        if captured.cu_window is not None and window is not None:
            captured.cu_window.copy_(torch.tensor(window, dtype=torch.int32), non_blocking=True)
        captured.graph.replay()
        return captured.merged, captured.deepstack

    # ---- capture (CUDA) --------------------------------------------------------------------------------
    def capture(self, dtype: torch.dtype, keys: Sequence[GraphKey] | None = None) -> int:
        """Capture a graph per key (default: the bucket ladder), largest first, in one shared pool.

        Returns the bytes the graphs hold: the pool and the static buffers. The warm-ups (kernels chosen,
        workspaces made, outside any graph) all run on ONE side stream, which the captures use too; its
        cached blocks serve no other stream, so the allocator's free cached blocks are released
        (empty_cache) before and after, and what is read is the growth of the pool's segments that stay
        in use. A caller that held memory as free cached blocks (a rank's reservation, meter.py) holds it
        again afterwards (vitserve/worker/graphs.py). Call after the weights are final and the varlen probe
        ran (one eager forward does it).
        """
        device = next(self.visual.parameters()).device
        if device.type != "cuda":
            raise ValueError("TowerRunner.capture needs a CUDA tower")
        v: Any = self.visual
        attn = v.blocks[0].attn
        heads = int(attn.num_heads)
        if varlen_kernel(device, dtype, heads, attn.qkv.out_features // 3 // heads) is None:
            # the grouped SDPA path syncs with the host: not capturable
            raise ValueError(f"TowerRunner.capture: no varlen attention kernel runs in {dtype} on {device}")
        before = _settled_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        for key in sorted(keys if keys is not None else self.keys, reverse=True):
            self.graphs[key] = self._capture_one(key, dtype, device, pool, side)
        grown = _settled_reserved(device) - before
        log.info("captured %d CUDA graphs, %.0f MiB", len(self.graphs), grown / 2**20)
        return grown

    def _capture_one(
        self, key: GraphKey, dtype: torch.dtype, device: torch.device, pool: Any, side: Any
    ) -> _Captured:
        v: Any = self.visual
        if key.bucket not in self._inputs:
            head_dim = v.blocks[0].attn.qkv.out_features // 3 // int(v.blocks[0].attn.num_heads)
            width = v.blocks[0].attn.qkv.in_features
            self._inputs[key.bucket] = (
                torch.zeros(key.bucket, width, dtype=dtype, device=device),
                torch.zeros(key.bucket, head_dim, dtype=torch.float32, device=device),
                torch.zeros(key.bucket, head_dim, dtype=torch.float32, device=device),
            )
        hidden, cos, sin = self._inputs[key.bucket]
        full = fill_slots([0, key.bucket], key.full_slots)
        cu_full = torch.tensor(full, dtype=torch.int32, device=device)
        cu_window = None
        if self.windowed:
            window = fill_slots(pad_bounds([0], key.bucket, self.window_rows), key.window_slots)
            cu_window = torch.tensor(window, dtype=torch.int32, device=device)
        args = (hidden, cos, sin, cu_full, cu_window, key.bucket, self.window_rows)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            self.body(*args)  # warm-up: kernels chosen, workspaces made, outside the graph
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=side):
            merged, levels = self.body(*args)
        return _Captured(graph, cu_full, cu_window, merged, levels)


def _settled_reserved(device: torch.device) -> int:
    """The CUDA pool's reserved bytes once the work is done and its free cached blocks are released."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def _call_block(
    blk: nn.Module, hidden: torch.Tensor, cu: torch.Tensor, max_len: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    out: torch.Tensor = blk(hidden, cu_seqlens=cu, max_seqlen=max_len, position_embeddings=(cos, sin))
    return out


def _max_len(bounds: Sequence[int]) -> int:
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)), default=0)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows`."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def install(visual: nn.Module, runner: TowerRunner) -> None:
    """Make the adapter's forward go through `runner` (vitserve/model/adapters.py reads it)."""
    setattr(visual, "_vitserve_runner", runner)  # noqa: B010 (nn.Module's typed __setattr__)


def installed(visual: nn.Module) -> TowerRunner | None:
    runner = visual.__dict__.get("_vitserve_runner")
    return runner if isinstance(runner, TowerRunner) else None
