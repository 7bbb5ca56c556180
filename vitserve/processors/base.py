"""The VisionProcessor interface every model family implements (docs/processing.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from PIL import Image

from vitserve.checkpoint import Checkpoint
from vitserve.contract import ProcessedImage
from vitserve.errors import VitserveError
from vitserve.images import to_rgb
from vitserve.processors.budget import Plan


class VisionProcessor(ABC):
    """A family adapter over a clamped Hugging Face image processor.

    ``count_tokens`` and ``preprocess`` both go through ``plan`` (the one token computation), and
    ``preprocess`` verifies that HF produced exactly the planned grid wherever HF's code runs (the Qwen families'
    exact fast path, vitserve/processors/pixels.py, builds the planned grid itself).
    """

    family: str
    hf: Any  # the clamped HF image processor object; calling it directly also respects the budget
    budget_tokens: int  # per-image token budget; 0 = no clamp
    checkpoint: Checkpoint | None = None  # what it was built from (None: a family's public defaults)

    @abstractmethod
    def plan(self, width: int, height: int) -> Plan:
        """Resized size, grid, tokens for an image of this size; raises ImageTooSmall /
        AspectRatioTooLarge / OverTokenBudget."""

    def count_tokens(self, width: int, height: int) -> int:
        """Exact merged-token count after clamping, without touching pixels."""
        return self.plan(width, height).num_tokens

    @abstractmethod
    def preprocess(self, image: Image.Image) -> ProcessedImage:
        """Pixels ready for the encoder."""

    @abstractmethod
    def clamp_info(self) -> dict[str, Any]:
        """The resolved clamp, for the start-up banner and /v1/info."""


def check_grid(plan: Plan, grid: tuple[int, int, int], family: str) -> None:
    """HF must have produced the grid the plan promised; anything else is a vitserve bug."""
    if tuple(grid) != plan.grid_thw:
        raise VitserveError(
            f"{family} processor produced grid {tuple(grid)} but the token plan said {plan.grid_thw}"
        )


def as_rgb(image: Image.Image) -> Image.Image:
    """vitserve's documented RGB conversion (alpha on white, 16-bit scaled, ...) for callers that pass a
    non-RGB image directly; HF's own conversion then has nothing left to do, on every resize path."""
    return image if image.mode == "RGB" else to_rgb(image)


def call_hf(hf: Any, image: Image.Image, family: str, **kwargs: Any) -> Any:
    """Call the HF image processor; its failures become a typed error."""
    try:
        return hf(image, return_tensors="pt", **kwargs)
    except Exception as exc:
        raise VitserveError(f"{family} image processor failed ({type(exc).__name__}: {exc})") from exc
