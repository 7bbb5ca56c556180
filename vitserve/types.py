"""Plain data passed between the processors, the encoder, the engine and the API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class ProcessedImage:
    """One image after the family's processor, ready for the encoder (docs/processing.md)."""

    pixel_values: torch.Tensor  # (num_patches, C*T*P*P) for Qwen families; (num_tiles, C, H, W) for InternVL
    grid_thw: tuple[int, int, int]  # patch grid before merge (InternVL: (num_tiles, h, w) of one tile)
    num_tokens: int  # merged tokens = rows of the embedding
    resized_size: tuple[int, int]  # (width, height) fed to the encoder
    clamped: bool  # True when the token budget shrank the image


@dataclass
class EncodedImage:
    """The encoder's output for one image (docs/processing.md)."""

    embedding: torch.Tensor  # (num_tokens, dim)
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each (num_tokens, dim); Qwen3-VL/3.5 only


@dataclass
class ImageResult:
    """What the engine returns per image of a request (the API turns it into the JSON of docs/api.md)."""

    num_tokens: int
    embedding: torch.Tensor | None  # (num_tokens, dim); None unless return_embeddings was asked
    deepstack: list[torch.Tensor] = field(default_factory=list)
    cached: bool = False
    timing_ms: dict[str, float] = field(default_factory=dict)  # "queue", "encode", "send"


class EncodeEngine(Protocol):
    """What the HTTP layer needs of an engine: vitserve.engine.Engine (tests also pass a fake)."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def readiness(self) -> tuple[bool, str]: ...

    def info(self) -> dict[str, Any]: ...

    @property
    def queue_tokens(self) -> int: ...

    async def encode(self, request_id: str, items: list[ProcessedImage], image_ids: list[str], *,
                     deadline: float, return_embeddings: bool) -> list[ImageResult]: ...
