"""The encoder interface every backend implements (real HF towers, the demo model, test fakes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from vitserve.contract import EncodedImage, ProcessedImage


@runtime_checkable
class Encoder(Protocol):
    family: str  # qwen2_vl | qwen2_5_vl | qwen3_vl | qwen3_5 | internvl
    model_name: str  # reported in responses and on the wire ("model")
    embed_dim: int  # columns of each embedding (after the merger / projector)
    num_deepstack: int  # deepstack tensors per image (Qwen3-VL / Qwen3.5), else 0
    dtype: torch.dtype
    device: torch.device
    weights_digest: (
        str  # checkpoint.WeightsDigest of what was loaded: keys the stored reservation and the caches
    )
    visual: (
        nn.Module
    )  # the vision tower + merger/projector that encode() runs; the TP pass shards it in place

    def encode(self, items: Sequence[ProcessedImage]) -> list[EncodedImage]:
        """One packed forward over all items; outputs in input order."""
        ...
