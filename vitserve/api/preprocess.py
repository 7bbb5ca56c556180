"""Decode + preprocess (vitserve.processors.prepare) every image of a request off the event loop, all-or-nothing.

The CPU work runs in one thread pool per server, sized to the machine: PIL decoding and the HF
processor's numpy/torch kernels release the GIL, so threads use every core, and one large image
occupies one worker while small ones keep flowing through the others.  The pool bounds how many
decoded images (the big intermediate) exist at once, across all requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vitserve.contract import PreparedImage
from vitserve.errors import InvalidImage, Timeout, VitserveError
from vitserve.metrics import Metrics
from vitserve.processors.base import VisionProcessor
from vitserve.processors.draft import JpegDraft
from vitserve.processors.prepare import prepare_image

log = logging.getLogger(__name__)
T = TypeVar("T")


def default_workers() -> int:
    return max(2, min(32, os.cpu_count() or 1))


class Preprocessor:
    """Owns the pool; `prepare(blobs)` returns every image ready for the engine, or raises for the first bad one."""

    def __init__(
        self,
        processor: VisionProcessor,
        *,
        max_image_pixels: int,
        metrics: Metrics,
        workers: int | None = None,
        jpeg_draft: bool = False,
    ):
        self.processor = processor
        self.draft = (
            JpegDraft(processor) if jpeg_draft else None
        )  # --jpeg_draft (vitserve/processors/draft.py)
        self.max_image_pixels = max_image_pixels
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(
            max_workers=workers or default_workers(), thread_name_prefix="vitserve-pre"
        )

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Any CPU-heavy call (JSON parsing, base64) on the pool instead of the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def prepare(
        self, blobs: list[bytes], deadline: float, ids: list[str] | None = None
    ) -> list[PreparedImage]:
        """`ids`: the blobs' sha256 when the caller has them already (not computed again)."""
        loop = asyncio.get_running_loop()
        known = ids if ids is not None else [None] * len(blobs)
        futures = [
            loop.run_in_executor(self.pool, self._prepare_one, data, image_id)
            for data, image_id in zip(blobs, known, strict=True)
        ]
        remaining = deadline - time.monotonic()
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), max(remaining, 0)
            )
        except TimeoutError:
            raise Timeout("decoding and preprocessing passed the deadline (--request_timeout_s)") from None
        for index, result in enumerate(results):  # the first image at fault, in request order
            if isinstance(result, VitserveError):
                raise result.with_index(index)
            if isinstance(result, BaseException):
                log.error("preprocessing image %d failed unexpectedly: %r", index, result)
                raise InvalidImage(f"image could not be preprocessed ({type(result).__name__})").with_index(
                    index
                )
        return results  # type: ignore[return-value]

    def _prepare_one(self, data: bytes, image_id: str | None) -> PreparedImage:
        prepared = prepare_image(
            data, self.processor, max_image_pixels=self.max_image_pixels, draft=self.draft, image_id=image_id
        )
        self.metrics.stage_seconds.labels(stage="decode").observe(prepared.decode_s)
        self.metrics.stage_seconds.labels(stage="preprocess").observe(prepared.preprocess_s)
        return prepared

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
