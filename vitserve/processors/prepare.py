"""prepare_image: the one path from received bytes to an image ready for the engine.

sha256 of the bytes as received -> safe decode (vitserve.images, with the --jpeg_draft target from
vitserve.processors.draft) -> the family processor's preprocess -> JpegDraft.finish. The API's pool
(vitserve/api/preprocess.py), the tests and bench/jpeg_draft.py all call this function; there is no other.
"""

from __future__ import annotations

import hashlib
import time

from vitserve.contract import PreparedImage
from vitserve.images import decode_image
from vitserve.processors.base import VisionProcessor
from vitserve.processors.draft import JpegDraft


def prepare_image(
    data: bytes,
    processor: VisionProcessor,
    *,
    max_image_pixels: int,
    draft: JpegDraft | None = None,
    image_id: str | None = None,
) -> PreparedImage:
    """Decode and preprocess one image; raises the typed errors of decoding and of the token plan.

    ``draft``: a JpegDraft for the same processor when --jpeg_draft is on, else None (full decode).
    ``image_id``: the bytes' hex sha256 when the caller computed it already (a chat request's hand-over
    looked the image up by it); else computed here.
    """
    t0 = time.perf_counter()
    if image_id is None:
        image_id = hashlib.sha256(data).hexdigest()
    decoded = decode_image(data, max_image_pixels=max_image_pixels, draft_target=draft)
    t1 = time.perf_counter()
    try:
        item = processor.preprocess(decoded.image)
        if draft is not None:
            item = draft.finish(item, decoded)
    finally:
        decoded.image.close()
    t2 = time.perf_counter()
    return PreparedImage(item, image_id, decoded.original_size, t1 - t0, t2 - t1, decoded.draft_scale)
