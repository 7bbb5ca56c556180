"""HFVisionEncoder: one packed forward of a transformers vision tower over a batch of processed images."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.model.adapters import FamilyAdapter


class HFVisionEncoder:
    """Implements vitserve.model.base.Encoder over a transformers vision module (see adapters.ADAPTERS)."""

    def __init__(
        self,
        visual: nn.Module,
        adapter: FamilyAdapter,
        *,
        model_name: str,
        embed_dim: int,
        num_deepstack: int,
        dtype: torch.dtype,
        device: torch.device,
        weights_digest: str,
    ) -> None:
        self.visual = visual
        self.adapter = adapter
        self.family = adapter.family
        self.model_name = model_name
        self.embed_dim = embed_dim
        self.num_deepstack = num_deepstack
        self.dtype = dtype
        self.device = device
        self.weights_digest = weights_digest

    def encode(self, items: Sequence[ProcessedImage]) -> list[EncodedImage]:
        """All items in one forward; attention never crosses images (HF's packed cu_seqlens / per-tile batch)."""
        if not items:
            return []
        pixel_values = torch.cat([it.pixel_values for it in items]).to(self.device, self.dtype)
        # (N, 3): Qwen (t, h, w) patch grids; InternVL's (tiles, h, w) is carried along but unused.
        grid_thw = torch.tensor([it.grid_thw for it in items], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            embeds, deepstack = self.adapter.forward(self.visual, pixel_values, grid_thw)  # (sum tokens, dim)
        sizes = [it.num_tokens for it in items]
        if embeds.shape[0] != sum(sizes):
            raise ValueError(
                f"encoder produced {embeds.shape[0]} rows for items announcing {sum(sizes)} tokens "
                f"(num_tokens {sizes}); the processor and the model disagree on patch/merge sizes"
            )
        rows = _split(embeds, sizes)
        per_layer = [_split(layer, sizes) for layer in deepstack]  # [layer][item]
        return [
            EncodedImage(embedding=rows[i], deepstack=[layer[i] for layer in per_layer])
            for i in range(len(items))
        ]


def _split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    # Clone each slice: a view would keep the whole batch's output alive for as long as any one image's
    # embedding is held (cache, send queue), and its nbytes would under-count that.
    return [part.clone() for part in torch.split(rows, sizes)]
