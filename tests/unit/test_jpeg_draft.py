"""Reduced-scale JPEG decoding (--jpeg_draft): never below the planned target, JPEG only, same plan as the
full decode, EXIF orientation respected, and the flag wiring."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bench.workloads import jpeg_bytes, photo_like, png_bytes
from vitserve.images import decode_image
from vitserve.processors import load_image_processor
from vitserve.processors.draft import JpegDraft
from vitserve.processors.prepare import prepare_image

pytestmark = pytest.mark.unit


def _prepare(data: bytes, processor, *, jpeg_draft: bool):
    """The production path (vitserve.processors.prepare), with or without --jpeg_draft."""
    return prepare_image(
        data, processor, max_image_pixels=0, draft=JpegDraft(processor) if jpeg_draft else None
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return photo_like(1600, 1200, seed=3)


@pytest.mark.parametrize(
    "target",
    [
        (800, 600),
        (799, 601),
        (400, 300),
        (401, 299),
        (200, 150),
        (150, 140),
        (60, 40),
        (1000, 100),
        (100, 700),
    ],
)
def test_draft_never_decodes_below_the_target_and_takes_the_largest_scale(photo, target):
    calls = []

    def draft_target(w, h):
        calls.append((w, h))
        return target

    decoded = decode_image(jpeg_bytes(photo), max_image_pixels=0, draft_target=draft_target)
    assert calls == [(1600, 1200)]
    assert decoded.original_size == (1600, 1200)
    s = decoded.draft_scale
    assert s in (1, 2, 4, 8)
    # the reduced decode (ceil(side / s)) is at least the target on both sides ...
    assert _ceil_div(1600, s) >= target[0]
    assert _ceil_div(1200, s) >= target[1]
    # ... and the next scale would have gone below it (or s is libjpeg's largest)
    if s < 8:
        assert 1600 // (2 * s) < target[0] or 1200 // (2 * s) < target[1]
    assert decoded.image.size == (target if s > 1 else (1600, 1200))
    assert decoded.image.mode == "RGB"


def test_draft_is_off_for_non_jpeg(photo):
    calls = []
    decoded = decode_image(
        png_bytes(photo), max_image_pixels=0, draft_target=lambda w, h: calls.append((w, h)) or (200, 150)
    )
    assert calls == []
    assert decoded.draft_scale == 1
    assert decoded.image.size == (1600, 1200)


def test_no_draft_target_decodes_exactly_as_before(photo):
    data = jpeg_bytes(photo)
    plain = decode_image(data, max_image_pixels=0)
    declined = decode_image(data, max_image_pixels=0, draft_target=lambda w, h: None)
    assert declined.draft_scale == plain.draft_scale == 1
    assert np.array_equal(np.asarray(plain.image), np.asarray(declined.image))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("budget", [16, 64, 256, 1024, 0])
@pytest.mark.parametrize("size", [(1600, 1200), (1200, 1600), (1599, 901), (3000, 200)])
def test_draft_keeps_the_full_paths_plan(family, budget, size):
    processor = load_image_processor(family, budget_tokens=budget)
    data = jpeg_bytes(photo_like(*size, seed=size[0]))
    full = _prepare(data, processor, jpeg_draft=False)
    draft = _prepare(data, processor, jpeg_draft=True)
    assert draft.original_size == full.original_size == size
    assert draft.item.grid_thw == full.item.grid_thw
    assert draft.item.num_tokens == full.item.num_tokens
    assert draft.item.resized_size == full.item.resized_size
    assert draft.item.clamped == full.item.clamped
    assert draft.item.pixel_values.shape == full.item.pixel_values.shape
    # the clamp shrinks these well below half: a draft must apply (qwen3_vl at 16/64 tokens shrinks below
    # its own min_pixels, a plan that is not a fixed point: JpegDraft keeps the full decode there)
    if (budget == 256 or (family == "qwen2_5_vl" and budget in (16, 64))) and size != (3000, 200):
        assert draft.draft_scale > 1
    if budget == 0:
        assert draft.draft_scale == 1  # no clamp: nothing shrinks 2x, nothing to gain


def test_draft_pixels_stay_close_to_the_full_decode():
    processor = load_image_processor("qwen2_5_vl", budget_tokens=64)
    data = jpeg_bytes(photo_like(1600, 1200, seed=9))
    full = _prepare(data, processor, jpeg_draft=False)
    draft = _prepare(data, processor, jpeg_draft=True)
    assert draft.draft_scale == 4
    # normalized pixels (CLIP std ~0.27 per 255 levels): a mean difference of 0.05 is ~3.5 grey levels
    assert float((full.item.pixel_values - draft.item.pixel_values).abs().mean()) < 0.05


def test_exif_rotation_is_planned_on_the_oriented_size():
    stored = photo_like(1600, 1200, seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: oriented size is 1200x1600
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    processor = load_image_processor("qwen2_5_vl", budget_tokens=64)
    full = _prepare(buf.getvalue(), processor, jpeg_draft=False)
    draft = _prepare(buf.getvalue(), processor, jpeg_draft=True)
    assert full.original_size == draft.original_size == (1200, 1600)
    assert draft.draft_scale > 1
    assert draft.item.resized_size == processor.plan(1200, 1600).resized_size
    assert draft.item.grid_thw == full.item.grid_thw
    assert draft.item.resized_size == full.item.resized_size


def test_internvl_keeps_the_full_decode():
    processor = load_image_processor("internvl", budget_tokens=256)
    assert JpegDraft(processor)(1600, 1200) is None


def test_pixel_limit_is_still_checked_before_any_decode(photo):
    from vitserve.errors import PayloadTooLarge

    with pytest.raises(PayloadTooLarge, match="--max_image_pixels"):
        decode_image(jpeg_bytes(photo), max_image_pixels=1000, draft_target=lambda w, h: (100, 75))


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, False),  # off by default: the draft is not exact (docs/jpeg_draft.md)
        (["--jpeg_draft"], {}, True),
        (["--jpeg-draft"], {}, True),
        ([], {"VITSERVE_JPEG_DRAFT": "1"}, True),
        (["--no-jpeg_draft"], {}, False),
        (["--no-jpeg-draft"], {}, False),
        ([], {"VITSERVE_JPEG_DRAFT": "0"}, False),
        ([], {"VITSERVE_JPEG_DRAFT": "false"}, False),
        (["--jpeg_draft"], {"VITSERVE_JPEG_DRAFT": "0"}, True),  # the flag wins
        (["--no-jpeg_draft"], {"VITSERVE_JPEG_DRAFT": "1"}, False),
    ],
)
def test_flag_and_environment_wiring(argv, environ, expected):
    from vitserve.flags import build_config

    assert build_config(argv, environ).jpeg_draft is expected


def test_bad_environment_value_names_the_variable():
    from vitserve.errors import ConfigError
    from vitserve.flags import build_config

    with pytest.raises(ConfigError, match="VITSERVE_JPEG_DRAFT"):
        build_config([], {"VITSERVE_JPEG_DRAFT": "maybe"})


@pytest.mark.parametrize("jpeg_draft", [True, False])
async def test_the_api_pipeline_uses_the_flag(jpeg_draft):
    import time

    from vitserve.api.preprocess import Preprocessor
    from vitserve.metrics import Metrics

    processor = load_image_processor("qwen2_5_vl", budget_tokens=64)
    data = jpeg_bytes(photo_like(1600, 1200, seed=11))
    pre = Preprocessor(processor, max_image_pixels=0, metrics=Metrics(), workers=1, jpeg_draft=jpeg_draft)
    try:
        (prepared,) = await pre.prepare([data], time.monotonic() + 60)
    finally:
        pre.close()
    via_draft = _prepare(data, processor, jpeg_draft=True)
    via_full = _prepare(data, processor, jpeg_draft=False)
    assert not torch.equal(via_draft.item.pixel_values, via_full.item.pixel_values)  # distinguishable paths
    expected = via_draft if jpeg_draft else via_full
    # exact by construction: the same decode and processor functions on the same bytes
    assert torch.equal(prepared.item.pixel_values, expected.item.pixel_values)
    assert prepared.original_size == (1600, 1200)
    assert prepared.item.grid_thw == processor.plan(1600, 1200).grid_thw
    assert prepared.item.clamped is True
    assert (prepared.draft_scale > 1) is jpeg_draft
    assert prepared.image_id == hashlib.sha256(data).hexdigest()  # of the bytes as received
