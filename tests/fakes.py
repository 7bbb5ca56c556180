"""Fakes that are real implementations of vitserve's interfaces, for tests where a real part cannot run."""


# --- tp helper: an Encoder over a real HF tower (until vitserve.model.load_encoder is on main) ---------------

import torch as _torch  # noqa: E402

from vitserve.types import EncodedImage as _EncodedImage  # noqa: E402


class TowerEncoder:
    """A real Encoder (vitserve/model/base.py) over an HF vision tower built in-process (tests/tp_towers.py).

    One packed forward per encode() call, like production: Qwen rows are concatenated with their grid_thw;
    InternVL tiles are stacked along the batch axis.
    """

    def __init__(self, family: str, visual, *, model_name: str = "tiny", device: str = "cpu"):
        self.family = family
        self.model_name = model_name
        self.visual = visual.to(device)
        self.device = _torch.device(device)
        self.dtype = next(visual.parameters()).dtype
        self.num_deepstack = len(getattr(getattr(visual, "config", None), "deepstack_visual_indexes", None) or [])
        self.embed_dim = self._out_dim()

    def _out_dim(self) -> int:
        if self.family == "internvl":
            return self.visual.multi_modal_projector.linear_2.out_features
        cfg = self.visual.config
        return getattr(cfg, "out_hidden_size", None) or cfg.hidden_size

    def encode(self, items):
        if not items:
            return []
        pixels = _torch.cat([i.pixel_values for i in items]).to(self.device, self.dtype)
        with _torch.inference_mode():
            if self.family == "internvl":
                feats = self.visual(pixels)  # (tiles, tokens_per_tile, dim)
                tiles = [i.pixel_values.shape[0] for i in items]
                return [_EncodedImage(f.reshape(-1, f.shape[-1])) for f in feats.split(tiles)]
            grid = _torch.tensor([i.grid_thw for i in items], device=self.device)
            out = self.visual(pixels, grid_thw=grid)
        sizes = [i.num_tokens for i in items]
        embeds = out.pooler_output.split(sizes)  # each (num_tokens, dim)
        deep = [d.split(sizes) for d in (getattr(out, "deepstack_features", None) or [])]
        return [_EncodedImage(e, [d[k] for d in deep]) for k, e in enumerate(embeds)]

# ------------------------------------------------------------------------------------------------------
# FakeEncoder (core): a deterministic Encoder with real computation and, at tp > 1, a real collective.
# ------------------------------------------------------------------------------------------------------

import hashlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from vitserve.types import EncodedImage, ProcessedImage  # noqa: E402

FAKE_PATCH_COLS = 3 * 2 * 14 * 14  # one Qwen2.5-VL patch row (C*T*P*P), so reservation's worst case fits
FAKE_MERGE = 4  # rows merged into one token, like the 2x2 spatial merge


def fake_weight(embed_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(FAKE_MERGE * FAKE_PATCH_COLS, embed_dim, generator=gen) / math.sqrt(FAKE_MERGE * FAKE_PATCH_COLS)


def fake_item(h_tokens: int, w_tokens: int, seed: int) -> ProcessedImage:
    """An image of h_tokens x w_tokens merged tokens, with seeded pixels."""
    gen = torch.Generator().manual_seed(seed)
    rows = FAKE_MERGE * h_tokens * w_tokens
    pixels = torch.randn(rows, FAKE_PATCH_COLS, generator=gen)  # (4 * tokens, C*T*P*P)
    return ProcessedImage(pixel_values=pixels, grid_thw=(1, 2 * h_tokens, 2 * w_tokens), num_tokens=h_tokens * w_tokens,
                          resized_size=(28 * w_tokens, 28 * h_tokens), clamped=False)


def fake_reference(item: ProcessedImage, embed_dim: int = 32, seed: int = 0) -> torch.Tensor:
    """What FakeEncoder computes for one image, in this process (for exactness checks)."""
    merged = item.pixel_values.reshape(-1, FAKE_MERGE * FAKE_PATCH_COLS)  # (tokens, 4 * cols)
    return merged @ fake_weight(embed_dim, seed)  # (tokens, dim)


def batch_hash(items) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(repr(tuple(it.grid_thw)).encode())
        h.update(it.pixel_values.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class _FakeVisual(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (4 * cols, dim / tp): this rank's columns
        # what reservation.worst_case_items reads for a Qwen-family tower
        self.config = SimpleNamespace(spatial_merge_size=2, patch_size=14, temporal_patch_size=2, in_channels=3)


class FakeEncoder:
    """embedding = (4 rows merged) @ W. At tp > 1 each rank owns dim/tp columns of W and the ranks
    all_gather their slices, so a rank that runs a different batch hangs or corrupts the result."""

    family = "qwen2_5_vl"
    model_name = "fake-encoder"
    num_deepstack = 0
    dtype = torch.float32
    device = torch.device("cpu")
    handles_tp = True  # shards itself; the worker must not run apply_tp on it

    def __init__(self, hooks: "FakeEncoderFactory", rank: int, tp: int):
        if hooks.embed_dim % tp:
            raise ValueError(f"embed_dim {hooks.embed_dim} is not divisible by --tp {tp}")
        self.embed_dim, self.hooks, self.rank, self.tp = hooks.embed_dim, hooks, rank, tp
        cols = hooks.embed_dim // tp
        self.visual = _FakeVisual(fake_weight(hooks.embed_dim, hooks.seed)[:, rank * cols:(rank + 1) * cols].clone())
        self.calls = 0

    def encode(self, items):
        self._hooks(items)
        self.calls += 1
        x = torch.cat([it.pixel_values for it in items])  # (sum rows, cols)
        local = x.reshape(-1, FAKE_MERGE * FAKE_PATCH_COLS) @ self.visual.weight  # (sum tokens, dim / tp)
        if self.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local)
            local = torch.cat(parts, dim=1)  # (sum tokens, dim)
        out = torch.split(local, [it.num_tokens for it in items])
        return [EncodedImage(embedding=e.contiguous()) for e in out]

    def _hooks(self, items) -> None:
        h = self.hooks
        if self.calls < h.hooks_after_calls:  # the reservation stress is call 0
            return
        if h.hash_log_dir:
            with open(os.path.join(h.hash_log_dir, f"rank{self.rank}-pid{os.getpid()}.log"), "a") as f:
                f.write(batch_hash(items) + "\n")
        if h.raise_on_rank == self.rank and self.calls >= h.raise_on_call:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if h.sleep_s:
            time.sleep(h.sleep_s)


@dataclass(frozen=True)
class FakeEncoderFactory:
    """A picklable encoder_factory: the engine sends it to every spawned rank, which calls it with the config."""

    embed_dim: int = 32
    seed: int = 0
    sleep_s: float = 0.0  # per forward, after the reservation
    raise_on_rank: int | None = None  # this rank's forward raises ...
    raise_on_call: int = 1  # ... from this encode() call on (call 0 is the reservation stress)
    hash_log_dir: str | None = None  # each rank appends a hash of every batch it ran
    hooks_after_calls: int = 1

    def __call__(self, config) -> FakeEncoder:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return FakeEncoder(self, rank, config.tp)
