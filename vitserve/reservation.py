"""Worst-case memory reservation (docs/design.md invariant 7) and its publication (docs/engine.md).

At start-up every rank runs the production `encoder.encode` on the batch that maximises activation memory
under the token budget (and, around it, other full-budget compositions: see stress_batches), keeps that
peak in the allocator, and publishes the number so that an LLM server sharing the device sizes its KV cache
after it. Nothing here allocates buffers production never allocates: the stress is a few `encode` calls on
batches the scheduler can form, one live at a time.

Which batch is the worst case:
- Qwen families: ONE image with the most tokens <= budget. Linear layers, norms and the merger cost memory
  linear in the total patch count, which is the same for one big image or many small ones at the same
  total; attention is per image (cu_seqlens), and every implementation costs at least as much for one
  image of n patches as for k images of n/k (eager/SDPA-math scores are O(n^2) per image; padded-batch
  kernels k*(n/k)^2; flash kernels are linear). Qwen2.5-VL runs window attention in most blocks (windows
  of `window_size` pixels, linear in n) but FULL attention over each whole image in
  `fullatt_block_indexes` — which is O(n^2) per image, so one big image is the worst case there as well.
  The grid is near-square with both sides multiples of `spatial_merge_size` (the processor's output shape).
  Measured with the production encoder (load_encoder of tests/checkpoints.py's tiny towers, fast kernels,
  CPU, peak RSS growth in a fresh process, 1024 tokens as 1 / 2 / 4 / 16 images): Qwen3-VL
  57.0 / 44.6 / 40.9 / 33.6 MiB, Qwen2.5-VL 46.7 / 35.3 / 30.2 MiB. With HF's eager attention the gap is
  far larger (tiny tower, 1024 tokens as 1 / 4 / 16 images: 525 / 59.7 / 14.7 MiB).
  Caveat on CPU: glibc's heap fragments, so a later batch (even the same one) can raise the RSS peak above
  the stress peak (scenario L3, tests/integration/test_memory_l3.py: +12-38 MiB over a 62-107 MiB
  growth); hence the multi-batch stress and CPU_HEAP_MARGIN. CUDA's caching allocator reuses its blocks.
- InternVL: every tile is encoded independently at the fixed tile size, so memory grows with the total
  number of tiles in the batch: as many tiles as the budget admits. The per-image tile cap is the
  processor's (clamped `max_patches` + the thumbnail) and is not known to the encoder; when the caller
  passes it (`max_tiles_per_image`), the tiles are split into images of at most that many, at most
  `max_batch_images` images; without it the budget alone bounds the batch (one image holding every tile —
  the same memory as several images, and never less than a real batch).
- Budget 0 (disabled): there is no bound on a batch, so no stress can cover it. We stress a documented
  default (`DISABLED_BUDGET_TOKENS`, the largest image HF's default Qwen2-VL processor yields:
  max_pixels 12845056 / 28^2) and log that `--visual_reserved_mem_gb` is the way to reserve more.

Measurement:
- CUDA: `reset_peak_memory_stats`, one `encode`, then the larger of the growth of `max_memory_reserved`
  over the pool before the stress and the peak of `max_memory_allocated` over what was allocated before
  (weights were resident before; the second covers activations served from blocks the pool already had).
  No `empty_cache`: the peak stays in the caching allocator for the life of the process, which is what
  makes it a reservation.
- CPU: peak RSS growth. We first return free heap pages to the OS (glibc `malloc_trim(0)`), so that memory
  left free by loading or earlier forwards does not hide part of the worst case; then reset the kernel's
  high-water mark (`echo 5 > /proc/self/clear_refs`) and read
  `VmHWM` after the forwards minus `VmRSS` before them (both from /proc/self/status), plus CPU_HEAP_MARGIN. If the reset is not
  allowed, `VmHWM` may stay at an older, higher peak and the growth reads 0; we then fall back to the
  growth of `ru_maxrss`, which has the same blind spot, and log it. With vitserve.model.fast's allocator
  setting (no mmap for large blocks, no trimming) the heap keeps that peak afterwards, like CUDA's pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import math
import os
import resource
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitserve.errors import ConfigError
from vitserve.families import DISABLED_BUDGET_TOKENS, FAMILIES, MAX_ASPECT_RATIO, tokens_per_tile
from vitserve.model.base import Encoder
from vitserve.types import ProcessedImage

log = logging.getLogger(__name__)

GIB = 1 << 30
# CPU only: the published bytes are the stress's RSS growth times (1 + this). Measured with
# tests/integration/test_memory_l3.py (tiny Qwen2-VL, budget 1024, 60 full-budget batches of six
# compositions after READY, one arena, the multi-batch stress): over 5 runs the runtime peak ended 0-63%
# above the stress growth (61.6 -> 100.1 MiB at worst), in steps of one batch's pixel bytes (19 MiB): glibc's
# heap fragments differently from run to run. Over-reserving host RAM on a CPU-only server costs little;
# under-reserving is what L3 forbids. CUDA's caching allocator shows no such drift
# (tests/unit/test_reservation.py) and gets no margin.
CPU_HEAP_MARGIN = 1.0
_FIELDS = {"device": str, "rank": int, "bytes": int, "source": str, "pid": int}


@dataclass(frozen=True)
class Reservation:
    bytes: int  # activation memory of the worst case (CUDA: max of pool and allocated-peak growth; CPU: RSS growth)
    source: str  # "stress" | "override"
    tokens: int = 0  # image tokens in the stressed batch (0 for an override)
    images: int = 0  # images in the stressed batch


# ---------------------------------------------------------------------------------------------------------
# The worst-case batch
# ---------------------------------------------------------------------------------------------------------


def worst_case_items(
    encoder: Encoder, budget_tokens: int, max_batch_images: int, *, max_tiles_per_image: int | None = None
) -> list[ProcessedImage]:
    """The synthetic batch that maximises activation memory under the budget and the batch-size cap.

    max_tiles_per_image: InternVL only, the processor's per-image tile limit (max_patches + 1), if known.
    """
    if max_batch_images < 1:
        raise ConfigError(f"--visual_infer_batch_size must be >= 1, got {max_batch_images}")
    if budget_tokens <= 0:
        log.warning(
            "--visual_batch_max_tokens 0 (budget off): no batch bound exists; stressing a default of %d tokens. "
            "Set --visual_reserved_mem_gb to reserve for larger batches.",
            DISABLED_BUDGET_TOKENS,
        )
        budget_tokens = DISABLED_BUDGET_TOKENS
    layout = getattr(FAMILIES.get(encoder.family), "layout", None)  # None: a family with no worst case
    if layout == "patches":
        return [_qwen_item(_vision_config(encoder), near_square_grid(budget_tokens))]
    if layout == "tiles":
        return _internvl_items(encoder, budget_tokens, max_batch_images, max_tiles_per_image)
    raise ConfigError(
        f"no worst-case shape for family {encoder.family!r}; set --visual_reserved_mem_gb to skip the stress"
    )


def stress_batches(
    encoder: Encoder, budget_tokens: int, max_batch_images: int, *, max_tiles_per_image: int | None = None
) -> Iterator[list[ProcessedImage]]:
    """The batches the start-up stress runs, one at a time: the worst case, other full-budget compositions,
    then the worst case again.

    One run of the worst case measures its activations on a clean heap, but on CPU the heap that runtime
    batches of other shapes leave behind is fragmented, and a later worst case then needs fresh pages on top
    (scenario L3 measured +5-20 MiB over a single-run reservation, tiny Qwen2-VL at 1024 tokens). Every
    batch here is one the scheduler can form at this budget, run through the same production forward, so the
    peak covers that fragmentation without allocating anything production would not.
    """
    yield worst_case_items(encoder, budget_tokens, max_batch_images, max_tiles_per_image=max_tiles_per_image)
    if getattr(FAMILIES.get(encoder.family), "layout", None) == "patches":
        cfg = _vision_config(encoder)
        budget = budget_tokens if budget_tokens > 0 else DISABLED_BUDGET_TOKENS
        for grids in _full_budget_grids(budget, max_batch_images):
            yield [_qwen_item(cfg, grid) for grid in grids]
    yield worst_case_items(encoder, budget_tokens, max_batch_images, max_tiles_per_image=max_tiles_per_image)


def _full_budget_grids(budget: int, max_images: int) -> list[list[tuple[int, int]]]:
    """(rows, cols) token grids of batches that fill the budget: one long thin image, max_images equal images,
    and a mix of halving sizes (1/2, 1/4, ...) up to max_images images."""
    rows = max(1, math.isqrt(budget) // 8)
    batches = [[(rows, budget // rows)]]
    equal = budget // max_images
    if max_images > 1 and equal >= 1:
        batches.append([near_square_grid(equal)] * max_images)
    sizes: list[int] = []
    left = budget
    while len(sizes) < max_images - 1 and left // 2 >= 1:
        sizes.append(left // 2)
        left -= left // 2
    if len(sizes) > 1:
        batches.append([near_square_grid(n) for n in [*sizes, left]])
    return batches


def near_square_grid(max_cells: int) -> tuple[int, int]:
    """(rows, cols), rows <= cols, with rows * cols <= max_cells maximal among grids a processor can emit
    (aspect ratio <= MAX_ASPECT_RATIO); among equals the most square one."""
    best = (1, 1)
    for rows in range(math.isqrt(max_cells), 0, -1):
        cols = max_cells // rows
        if cols > MAX_ASPECT_RATIO * rows:
            break  # fewer rows only gets longer and thinner
        if rows * cols > best[0] * best[1]:
            best = (rows, cols)
        if rows * cols == max_cells:
            break
    return best


def _qwen_item(cfg: Any, grid: tuple[int, int]) -> ProcessedImage:
    merge = int(cfg.spatial_merge_size)
    patch = _first(cfg.patch_size)
    temporal = _first(getattr(cfg, "temporal_patch_size", 2))
    channels = int(getattr(cfg, "in_channels", None) or getattr(cfg, "in_chans", None) or 3)
    rows, cols = grid  # merged tokens
    h, w = rows * merge, cols * merge  # patches; multiples of merge_size like the processor's output
    gen = torch.Generator().manual_seed(0)  # same pixels on every TP rank
    pixels = torch.randn(h * w, channels * temporal * patch * patch, generator=gen)  # (h*w, C*T*P*P)
    return ProcessedImage(
        pixel_values=pixels,
        grid_thw=(1, h, w),
        num_tokens=rows * cols,
        resized_size=(w * patch, h * patch),
        clamped=False,
    )


def _internvl_items(
    encoder: Encoder, budget_tokens: int, max_batch_images: int, max_tiles_per_image: int | None
) -> list[ProcessedImage]:
    cfg = _vision_config(encoder)
    image_size = _first(cfg.image_size)
    patch = _first(cfg.patch_size)
    ratio = float(_find_attr(encoder, "downsample_ratio", 0.5))
    side = image_size // patch  # patches per tile side
    per_tile = tokens_per_tile(image_size, patch, ratio)
    channels = int(getattr(cfg, "num_channels", 3))
    if per_tile > budget_tokens:
        raise ConfigError(
            f"one InternVL tile is {per_tile} tokens, above --visual_batch_max_tokens {budget_tokens}"
        )
    tiles = budget_tokens // per_tile
    per_image = max(1, max_tiles_per_image) if max_tiles_per_image else tiles
    tiles = min(tiles, max_batch_images * per_image)
    gen = torch.Generator().manual_seed(0)
    items = []
    while tiles > 0:
        n = min(tiles, per_image)
        pixels = torch.randn(n, channels, image_size, image_size, generator=gen)  # (tiles, C, H, W)
        items.append(
            ProcessedImage(
                pixel_values=pixels,
                grid_thw=(n, side, side),
                num_tokens=n * per_tile,
                resized_size=(image_size, image_size),
                clamped=False,
            )
        )
        tiles -= n
    return items


def _vision_config(encoder: Encoder) -> Any:
    """The tower's vision config: visual.config (Qwen towers), or visual.vision_tower.config (InternVL)."""
    visual = encoder.visual
    tower = getattr(visual, "vision_tower", None)
    cfg = getattr(visual, "config", None) or getattr(tower, "config", None)
    if cfg is None:
        raise ConfigError("the encoder's visual module has no config; set --visual_reserved_mem_gb to skip the stress")
    return getattr(cfg, "vision_config", None) or cfg


def _find_attr(encoder: Encoder, name: str, default: Any) -> Any:
    """InternVL keeps downsample_ratio on the full-model config; look where a loader may have put it."""
    visual = encoder.visual
    cfg = getattr(visual, "config", None)
    for holder in (encoder, visual, cfg, getattr(cfg, "vision_config", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if value is not None:
            return value
    return default


def _first(value: Any) -> int:
    """HF configs give sizes as an int or a per-axis list; the towers here are square."""
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


# ---------------------------------------------------------------------------------------------------------
# The stress
# ---------------------------------------------------------------------------------------------------------


def reserve(
    encoder: Encoder,
    *,
    budget_tokens: int,
    max_batch_images: int,
    override_gb: float | None,
    max_tiles_per_image: int | None = None,
) -> Reservation:
    """Run the production forward on the worst case (or honour the override) and return what is held.

    max_tiles_per_image: InternVL only, see worst_case_items.
    """
    if override_gb is not None:
        return _reserve_override(encoder.device, override_gb)
    shape: list[int] = []  # (tokens, images) of the worst-case batch, filled in by run()

    def run() -> None:
        # Batches are built inside the measured window: at runtime a batch's pixel tensors are live in the
        # worker during its forward too, so on CPU they belong to the peak.
        for items in stress_batches(encoder, budget_tokens, max_batch_images, max_tiles_per_image=max_tiles_per_image):
            if not shape:
                shape[:] = [sum(i.num_tokens for i in items), len(items)]
            encoder.encode(items)
            del items  # one batch live at a time, as in the worker loop

    if torch.device(encoder.device).type == "cuda":
        nbytes = _stress_cuda(torch.device(encoder.device), run)
    else:
        nbytes = _stress_cpu(run)
    log.info("reserved %d bytes for the worst case (%d tokens in %d images)", nbytes, *shape)
    return Reservation(bytes=nbytes, source="stress", tokens=shape[0], images=shape[1])


def _reserve_override(device: torch.device | str, override_gb: float) -> Reservation:
    if override_gb < 0:
        raise ConfigError(f"--visual_reserved_mem_gb must be >= 0, got {override_gb}")
    nbytes = int(override_gb * GIB)
    dev = torch.device(device)
    if dev.type == "cuda" and nbytes > 0:
        # Allocate and free into the caching allocator: the block stays held by this process (no empty_cache).
        block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del block
    return Reservation(bytes=nbytes, source="override")


def _stress_cuda(dev: torch.device, run: Callable[[], None]) -> int:
    torch.cuda.synchronize(dev)
    reserved_before = torch.cuda.memory_reserved(dev)
    allocated_before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    torch.cuda.synchronize(dev)
    peak_alloc = torch.cuda.max_memory_allocated(dev) - allocated_before
    held = torch.cuda.max_memory_reserved(dev) - reserved_before
    log.info("stress peak: allocated +%d bytes, allocator pool +%d bytes (kept, no empty_cache)", peak_alloc, held)
    return max(held, peak_alloc)


def _stress_cpu(run: Callable[[], None]) -> int:
    _release_free_heap()
    reset = _reset_rss_peak()
    rss_before = _proc_status_kib("VmRSS")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    run()
    hwm = _proc_status_kib("VmHWM")
    if reset and hwm is not None and rss_before is not None:
        # The baseline is logged so that a test (or an operator) can check runtime peaks against it.
        log.info("CPU stress: VmRSS %d KiB before, VmHWM %d KiB after", rss_before, hwm)
        return _with_heap_margin(max(hwm - rss_before, 0) * 1024)
    log.warning("could not reset the RSS high-water mark; the CPU reservation may read low")
    return _with_heap_margin(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before, 0) * 1024)


def _with_heap_margin(growth: int) -> int:
    """The measured growth plus CPU_HEAP_MARGIN of it: glibc's heap fragments differently from run to run
    (the zmq, liveness and torch threads allocate concurrently), so the same full-budget batches can end a
    few tens of MiB above a peak measured once. See CPU_HEAP_MARGIN for the numbers."""
    return int(growth * (1 + CPU_HEAP_MARGIN))


def _release_free_heap() -> None:
    """Give free heap pages back to the OS first (glibc malloc_trim), so the RSS growth counts the whole
    worst case and not only what the heap lacked after earlier work (loading, a previous forward)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth may read low
        pass


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0) so the next read is the peak of what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---------------------------------------------------------------------------------------------------------
# Publication (docs/engine.md)
# ---------------------------------------------------------------------------------------------------------


def reservation_path(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> Path:
    safe_device = str(device).replace(os.sep, "_")
    return Path(runtime_dir) / f"reserved_mem_{safe_device}_{int(rank)}.json"


def publish_reservation(runtime_dir: str | os.PathLike[str], device: str, rank: int, nbytes: int, source: str) -> Path:
    """Write the reservation atomically: a temp file in the same directory, fsync, then os.replace."""
    path = reservation_path(runtime_dir, device, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"device": str(device), "rank": int(rank), "bytes": int(nbytes), "source": source, "pid": os.getpid()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a partial write
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_reservation(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> dict[str, Any] | None:
    """The published reservation, or None when it is not (yet) known. Never raises."""
    try:
        text = reservation_path(runtime_dir, device, rank).read_text()
        body = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    for key, kind in _FIELDS.items():
        value = body.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return None
    return {key: body[key] for key in _FIELDS}


def remove_reservation(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> None:
    """Delete this rank's file on clean shutdown; a missing file is fine."""
    try:
        reservation_path(runtime_dir, device, rank).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove the reservation file: %s", exc)
