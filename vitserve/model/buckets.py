"""Token buckets for CUDA graphs: which bucket a batch pads up to, the padded attention offsets, the graph key.

A CUDA graph replays fixed shapes, so a batch of N patch rows runs in the graph of the smallest bucket >= N,
its rows padded with zeros up to the bucket. The padding never meets a real row: it is attention segments of
its own (at most `chunk` rows each, so the layer's static max length holds), appended after the real ones, and
it is cut from the output. The varlen kernel also takes a fixed segment count, so the offsets are filled up
to `slots` segments with empty ones (offsets repeating the total), which attend to nothing.

The graph key is (bucket, full-attention slots, window slots): graphs are captured for a ladder of slot counts
per bucket (vitserve/model/tower_graphs.py); a batch takes the smallest captured graph that holds it, and a
batch that no graph holds (above the largest bucket, more images than any ladder step) runs eagerly, unpadded.
Units: a bucket counts patch ROWS (what the tower's blocks see); a budget counts MERGED TOKENS (Config's
`visual_batch_max_tokens`, what the LLM receives). One merged token is merge**2 rows (4 for every Qwen tower):
`budget_rows` converts, and nothing else mixes the two. Pure code: tested on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# patch rows; multiples of every merge unit (4); the top is a 16,384-token budget (65,536 rows)
DEFAULT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_IMAGE_LADDER = (1, 4, 16, 64)  # images per batch that each bucket's graphs are captured for


@dataclass(frozen=True, order=True)
class GraphKey:
    """What a captured graph's shapes are: rows, and segments of each kind of attention layer."""

    bucket: int  # padded patch rows
    full_slots: int  # segments of the full-attention offsets (images + padding + empty)
    window_slots: int  # segments of the window offsets; 0 when the tower has no window layers


def budget_rows(visual_batch_max_tokens: int, merge_unit: int) -> int:
    """The patch rows of a full batch under a budget of merged tokens: tokens * merge**2 (merge_unit)."""
    return visual_batch_max_tokens * merge_unit


def choose_bucket(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows`, or None above the largest (the batch then runs eagerly)."""
    fitting = [b for b in buckets if b >= rows]
    return min(fitting) if fitting else None


def pad_bounds(bounds: Sequence[int], rows: int, chunk: int) -> list[int]:
    """Segment offsets of a batch padded to `rows`: the real ones, then the padding in segments of <= chunk.

    bounds: the batch's cumulative offsets (0, ..., n_real); rows >= n_real; chunk >= 1.
    """
    if chunk < 1:
        raise ValueError(f"pad_bounds: chunk must be >= 1, got {chunk}")
    out = list(bounds)
    if rows < out[-1]:
        raise ValueError(f"pad_bounds: {out[-1]} rows do not fit in {rows}")
    while out[-1] < rows:
        out.append(min(out[-1] + chunk, rows))
    return out


def fill_slots(bounds: Sequence[int], slots: int) -> list[int]:
    """`bounds` with empty segments appended up to `slots` segments (slots + 1 offsets)."""
    if len(bounds) - 1 > slots:
        raise ValueError(f"fill_slots: {len(bounds) - 1} segments do not fit in {slots} slots")
    return list(bounds) + [bounds[-1]] * (slots + 1 - len(bounds))


def window_slots_bound(rows: int, images: int, window_rows: int) -> int:
    """At most how many window segments `images` images of `rows` patches in all can make.

    An image of h x w patches has ceil(h/s) * ceil(w/s) windows of s x s patches (s*s = window_rows) <=
    hw/s^2 + (h + w)/s + 1, and (h + w) <= hw/2 + 2 for h, w >= 2: so <= rows/s^2 + rows/(2s) + 2 per image
    summed, plus one for rounding.
    """
    side = max(1, math.isqrt(window_rows))
    return rows // (side * side) + rows // (2 * side) + 2 * images + 1


def pick_key(
    captured: Iterable[GraphKey], rows: int, full_segments: int, window_segments: int, window_chunk: int
) -> GraphKey | None:
    """The cheapest captured graph that holds a batch of `rows` rows with these real segment counts once
    padded to its bucket (the padding's own segments counted), or None: the batch runs eagerly.

    window_chunk: the window layers' static max length (their padding segments' size); full layers pad in
    one segment of at most the bucket. A tower without window layers passes window_segments 0.
    """
    fits = []
    for key in captured:
        if key.bucket < rows:
            continue
        pad = key.bucket - rows
        windows = segments_needed(window_segments, pad, window_chunk) if key.window_slots else 0
        if key.full_slots >= segments_needed(full_segments, pad, key.bucket) and key.window_slots >= windows:
            fits.append(key)
    return min(fits) if fits else None


def segments_needed(real_segments: int, pad_rows: int, chunk: int) -> int:
    """Segments a batch takes once padded: its own plus the padding's (ceil(pad_rows / chunk))."""
    return real_segments + -(-pad_rows // chunk)


def ladder_keys(
    buckets: Sequence[int], image_ladder: Sequence[int], window_rows: int | None
) -> list[GraphKey]:
    """The keys captured at start-up: per bucket, one per image-count step that fits the bucket (every step
    of at least 4 rows per image, the smallest image), slots enough for that many images and the padding.
    window_rows: the window layers' segment size (patches), None for a tower without window layers."""
    keys = []
    for bucket in sorted(buckets):
        for images in sorted({min(i, bucket // 4) for i in image_ladder}):
            windows = 0
            if window_rows is not None:
                windows = window_slots_bound(bucket, images, window_rows) + -(-bucket // window_rows)
            keys.append(GraphKey(bucket, images + 1, windows))
    return keys
