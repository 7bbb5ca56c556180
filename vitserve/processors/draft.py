"""Reduced-scale JPEG decoding (--jpeg_draft): decode big JPEGs at 1/2, 1/4 or 1/8 scale when the budget
clamp will shrink them anyway.

libjpeg can skip most of the inverse DCT and colour conversion by decoding at a power-of-two reduction
(PIL's ``Image.draft``). When the processor's plan for the header size (after EXIF orientation) resizes the
image to at most half its size, vitserve.images.decode_image decodes at the largest such scale that is still
>= the planned target in both sides (never upsampled), then resizes to exactly the target with the
processors' bicubic filter. The processor then sees an image already at its planned size: same grid, same
token count as the full decode. Embeddings differ slightly (a DCT-domain reduction, then bicubic, instead of
one bicubic from full size); bench/jpeg_draft.py measures how much, see bench/RESULTS.md. That is why the
flag is off by default: with it on, output is not exact (docs/jpeg_draft.md).

Patch-layout (Qwen) families only: their plan maps a target-sized image onto itself. InternVL's tiling (and its thumbnail
tile, resized from the whole image) is left on the full decode.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vitserve.contract import ProcessedImage
from vitserve.errors import VitserveError
from vitserve.families import FAMILIES
from vitserve.images import DecodedImage

if TYPE_CHECKING:  # importing vitserve.processors loads transformers; only the type is needed here
    from vitserve.processors.base import VisionProcessor


class JpegDraft:
    """The DraftTarget for one VisionProcessor: ``draft(width, height) -> (w, h) | None``."""

    def __init__(self, processor: VisionProcessor) -> None:
        self.processor = processor
        self.enabled = FAMILIES[processor.family].layout == "patches"

    def __call__(self, width: int, height: int) -> tuple[int, int] | None:
        if not self.enabled:
            return None
        plan = self.processor.plan(width, height)  # raises the same typed errors preprocess would
        target = plan.resized_size
        if target[0] * 2 > width or target[1] * 2 > height:
            return None  # no power-of-two reduction keeps the target
        try:
            again = self.processor.plan(*target)
        except VitserveError:  # e.g. a target below min_pixels that the processor would grow again
            return None
        if again.grid_thw != plan.grid_thw or again.resized_size != target:
            return None  # the plan is not a fixed point here: keep the full decode, exact grid guaranteed
        return target

    def finish(self, item: ProcessedImage, decoded: DecodedImage) -> ProcessedImage:
        """Restore what the full path reports: ``clamped`` is about the original size, not the target's."""
        if decoded.draft_scale == 1:
            return item
        return dataclasses.replace(item, clamped=self.processor.plan(*decoded.original_size).clamped)
