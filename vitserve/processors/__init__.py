"""Model-family image processors with an unbreakable per-image token budget (docs/processing.md, docs/design.md invariant 1).

Usage: ``proc = load_image_processor(Checkpoint | checkpoint_dir | family, budget_tokens=8192)``, then
``proc.count_tokens(width, height) -> int`` and ``proc.preprocess(pil_image) -> ProcessedImage``.

The names load on first use (PEP 562): importing one module of the package, as the video decoder processes
import vitserve.processors.pixels, does not import transformers through this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitserve.lazy import lazy_names

if TYPE_CHECKING:
    from vitserve.processors.base import VisionProcessor
    from vitserve.processors.budget import Plan
    from vitserve.processors.load import load_image_processor

# public name -> module that defines it
_LAZY = {
    "Plan": "vitserve.processors.budget",
    "VisionProcessor": "vitserve.processors.base",
    "load_image_processor": "vitserve.processors.load",
}

__all__ = [
    "Plan",
    "VisionProcessor",
    "load_image_processor",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
