"""decode_image (docs/processing.md; docs/design.md invariant 14): every expected pixel is computed here by hand with numpy."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.imagegen import animated_gif, encode, noise, palette_with_alpha, png_header_only, with_orientation
from tests.profiles import examples
from vitserve.errors import InvalidImage, PayloadTooLarge
from vitserve.images import decode_image

LIMIT = 50_000_000


def _pixels(data: bytes) -> np.ndarray:
    decoded = decode_image(data, max_image_pixels=LIMIT)
    assert decoded.image.mode == "RGB"
    return np.asarray(decoded.image)


def _on_white(color: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Composite on white, by hand in floating point: c * a + 255 * (1 - a)."""
    a = alpha.astype(np.float64)[..., None] / 255.0
    return np.round(color.astype(np.float64) * a + 255.0 * (1.0 - a)).astype(np.uint8)


# --- bad data -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b"GIF89a" + b"\xff" * 10],
    ids=["empty", "text", "png-garbage", "gif-garbage"],
)
def test_bad_data_is_invalid_image(data):
    with pytest.raises(InvalidImage):
        decode_image(data, max_image_pixels=LIMIT)


def test_format_outside_allowlist_is_refused():
    data = encode(
        noise(8, 8), "ICO"
    )  # PIL reads ICO happily; the format allowlist in docs/processing.md excludes it
    assert Image.open(io.BytesIO(data)).format == "ICO"
    with pytest.raises(InvalidImage, match="allowlist"):
        decode_image(data, max_image_pixels=LIMIT)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_is_invalid(fmt):
    data = encode(noise(64, 64, seed=1), fmt)
    with pytest.raises(InvalidImage, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2], max_image_pixels=LIMIT)


def test_allowed_formats_decode():
    img = noise(17, 9, seed=2)
    for fmt in ("PNG", "BMP", "TIFF"):
        assert np.array_equal(_pixels(encode(img, fmt)), np.asarray(img)), fmt
    for fmt, kw in (("JPEG", {"quality": 95}), ("WEBP", {"lossless": True})):
        decoded = decode_image(encode(img, fmt, **kw), max_image_pixels=LIMIT)
        assert decoded.format == fmt
        assert decoded.original_size == (17, 9)


def test_no_image_bytes_in_error_message():
    data = b"\x89PNG\r\n\x1a\n" + b"SECRET-PIXELS" * 10
    with pytest.raises(InvalidImage) as info:
        decode_image(data, max_image_pixels=LIMIT)
    assert "SECRET" not in str(info.value)


# --- pixel limit, from the header -----------------------------------------------------------------------


def test_bomb_header_refused_before_decoding():
    data = png_header_only(30000, 30000)
    assert len(data) < 100
    # The file holds almost no pixel data: had it been decoded first, the error would be "truncated".
    with pytest.raises(PayloadTooLarge, match="--max_image_pixels") as info:
        decode_image(data, max_image_pixels=LIMIT)
    assert "30000x30000" in str(info.value)


def test_our_limit_decides_not_pils():
    # 14000 x 14000 = 196 MP is over PIL's own bomb error threshold (2 x 89.5 MP); with our limit above it,
    # PIL must not refuse: the header check passes and the missing data is reported as corrupt.
    data = png_header_only(14000, 14000, bit_depth=1, color_type=0)
    with pytest.raises(InvalidImage):
        decode_image(data, max_image_pixels=200_000_000)


def test_limit_is_inclusive():
    img = noise(10, 10)
    assert decode_image(encode(img, "PNG"), max_image_pixels=100).original_size == (10, 10)
    with pytest.raises(PayloadTooLarge):
        decode_image(encode(img, "PNG"), max_image_pixels=99)


# --- modes -> 8-bit RGB ---------------------------------------------------------------------------------


def test_rgba_composited_on_white():
    img = noise(23, 11, seed=3, mode="RGBA")
    arr = np.asarray(img)
    assert np.array_equal(_pixels(encode(img, "PNG")), _on_white(arr[..., :3], arr[..., 3]))


def test_la_composited_on_white():
    img = noise(13, 7, seed=4, mode="LA")
    arr = np.asarray(img)
    grey = np.repeat(arr[..., :1], 3, axis=-1)
    assert np.array_equal(_pixels(encode(img, "PNG")), _on_white(grey, arr[..., 1]))


def test_palette_with_transparency_composited_on_white():
    img, palette, alpha = palette_with_alpha(19, 5, seed=5)
    indices = np.asarray(img)
    expected = _on_white(palette[indices], alpha[indices])
    assert np.array_equal(_pixels(encode(img, "PNG")), expected)


def test_palette_without_transparency():
    img, palette, _ = palette_with_alpha(9, 4, seed=6)
    del img.info["transparency"]
    assert np.array_equal(_pixels(encode(img, "PNG")), palette[np.asarray(img)])


def test_sixteen_bit_greyscale_is_scaled_not_clipped():
    rng = np.random.default_rng(7)
    values = rng.integers(0, 65536, size=(6, 10)).astype(np.uint16)
    values[0, :4] = [0, 65535, 257, 32896]
    img = Image.fromarray(values)
    assert img.mode == "I;16"
    expected_grey = np.round(values.astype(np.float64) / 257.0).astype(np.uint8)  # 0..65535 -> 0..255
    got = _pixels(encode(img, "PNG"))
    assert np.array_equal(got, np.repeat(expected_grey[..., None], 3, axis=-1))
    assert list(got[0, :4, 0]) == [0, 255, 1, 128]


def test_cmyk_uses_the_documented_conversion():
    img = noise(15, 8, seed=8, mode="CMYK")
    cmyk = np.asarray(img).astype(np.float64)
    expected = np.round((255.0 - cmyk[..., :3]) * (255.0 - cmyk[..., 3:4]) / 255.0).astype(np.uint8)
    assert np.array_equal(_pixels(encode(img, "TIFF")), expected)


def test_one_bit_and_greyscale():
    rng = np.random.default_rng(9)
    bits = rng.integers(0, 2, size=(5, 12)).astype(bool)
    got = _pixels(encode(Image.fromarray(bits), "PNG"))
    assert np.array_equal(got, np.repeat((bits * 255).astype(np.uint8)[..., None], 3, axis=-1))
    grey = noise(7, 3, seed=10, mode="L")
    assert np.array_equal(_pixels(encode(grey, "PNG")), np.repeat(np.asarray(grey)[..., None], 3, axis=-1))


def test_float_image_in_unit_range():
    values = np.linspace(0.0, 1.0, 24, dtype=np.float32).reshape(4, 6)
    got = _pixels(encode(Image.fromarray(values, "F"), "TIFF"))
    # exact on every CPU: one IEEE float32 multiply and round per pixel, no reduction or kernel choice
    assert np.array_equal(got[..., 0], np.round(values * 255.0).astype(np.uint8))


# --- EXIF orientation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_exif_orientation_6_lossless(fmt):
    upright = noise(30, 20, seed=11)
    stored = upright.rotate(90, expand=True)  # orientation 6 = "rotate 90 clockwise to display"
    decoded = decode_image(with_orientation(stored, fmt, 6), max_image_pixels=LIMIT)
    assert decoded.original_size == (30, 20)
    assert np.array_equal(np.asarray(decoded.image), np.asarray(upright))


def test_exif_orientation_6_jpeg():
    stored = noise(32, 16, seed=12)
    data = with_orientation(stored, "JPEG", 6, quality=90)
    raw = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # the stored pixels, not rotated
    decoded = decode_image(data, max_image_pixels=LIMIT)
    assert decoded.original_size == (16, 32)
    assert np.array_equal(np.asarray(decoded.image), np.rot90(raw, k=-1))  # clockwise, exact


# --- animations -----------------------------------------------------------------------------------------


def test_animated_gif_gives_first_frame():
    data, first = animated_gif(300)
    decoded = decode_image(data, max_image_pixels=LIMIT)
    assert decoded.format == "GIF"
    assert np.array_equal(np.asarray(decoded.image), np.asarray(first))


def test_animated_gif_later_frames_are_never_read():
    data, first = animated_gif(300)
    cut = data[: len(data) // 2]  # frames past the middle are gone; reading them would fail
    assert np.array_equal(np.asarray(decode_image(cut, max_image_pixels=LIMIT).image), np.asarray(first))


def test_real_60_megapixel_image_refused_from_header():
    # a decompression bomb (invariant 14): a real, valid 8000x7500 JPEG (60 MP) over the 50 MP default
    data = encode(Image.new("L", (8000, 7500)), "JPEG", quality=10)
    with pytest.raises(PayloadTooLarge, match="--max_image_pixels"):
        decode_image(data, max_image_pixels=LIMIT)


# --- fuzz: only the documented error types escape (invariant 14, in-process and time-boxed) -------------

_SEEDS = [
    encode(noise(12, 9, seed=13), "PNG"),
    encode(noise(12, 9, seed=13), "JPEG"),
    encode(noise(12, 9, seed=13, mode="RGBA"), "WEBP"),
    encode(noise(12, 9, seed=13), "BMP"),
    encode(noise(12, 9, seed=13, mode="CMYK"), "TIFF"),
    animated_gif(5)[0],
]


@settings(max_examples=examples(600), deadline=None)
@given(
    seed=st.sampled_from(_SEEDS),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
    cut=st.integers(0, 10_000),
)
def test_mutated_images_raise_only_documented_errors(seed, flips, cut):
    data = bytearray(seed)
    for pos, value in flips:
        data[pos % len(data)] = value
    data = data[: max(0, len(data) - cut % (len(data) + 1))]
    try:
        decoded = decode_image(bytes(data), max_image_pixels=100_000)
    except (InvalidImage, PayloadTooLarge):
        return
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == decoded.original_size


def test_alpha_compositing_is_exact_for_every_colour_alpha_pair():
    colour, alpha = np.meshgrid(np.arange(256), np.arange(256))  # every (c, a) pair
    rgba = np.stack([colour, colour, colour, alpha], axis=-1).astype(np.uint8)  # (256, 256, 4)
    got = _pixels(encode(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert np.array_equal(got, _on_white(rgba[..., :3], rgba[..., 3]))
