"""Every decoding rule of docs/processing.md against numpy references built from the raw samples
(tests/image_corpus.py), at the decode_image level; plus the refusals with their documented error codes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from tests.image_corpus import (
    grey3,
    on_white,
    polyglot_samples,
    refused_samples,
    scale16,
    valid_samples,
)
from vitserve.errors import InvalidImage, VitserveError
from vitserve.images import decode_image, to_rgb

pytestmark = pytest.mark.unit
LIMIT = 50_000_000

VALID = valid_samples(range(2), sizes=((23, 17), (16, 31))) + polyglot_samples()
REFUSED = [s for s in refused_samples() if s.code != "aspect_ratio_too_large"]  # that one is the processor's


@pytest.mark.parametrize("sample", VALID, ids=lambda s: s.name)
def test_valid_file_decodes_to_the_numpy_reference(sample):
    decoded = decode_image(sample.data, max_image_pixels=LIMIT)
    assert decoded.image.mode == "RGB"
    assert decoded.original_size == sample.size
    got = np.asarray(decoded.image)
    if sample.rgb is not None:
        assert got.shape == sample.rgb.shape
        diff = np.abs(got.astype(int) - sample.rgb.astype(int))
        assert diff.max() == 0, f"{sample.name}: {int((diff > 0).sum())} samples differ, up to {diff.max()}"


@pytest.mark.parametrize("sample", REFUSED, ids=lambda s: s.name)
def test_refused_file_gets_its_documented_error(sample):
    with pytest.raises(VitserveError) as info:
        decode_image(sample.data, max_image_pixels=LIMIT)
    assert info.value.code == sample.code, info.value.message


def test_unsupported_codec_is_named_and_still_an_invalid_image():
    sample = next(s for s in REFUSED if s.name == "tiff-codec-webp")
    with pytest.raises(InvalidImage) as info:  # every handler of bad images handles it
        decode_image(sample.data, max_image_pixels=LIMIT)
    assert info.value.code == "unsupported_image"
    assert info.value.status == 400
    assert "webp" in info.value.message
    assert "50001" in info.value.message


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("tiff-codec-34887", ("LERC", "34887")),
        ("tiff-codec-50002", ("JPEG XL", "50002")),
        ("bmp-jpeg-inside", ("BMP", "JPEG")),
        ("bmp-png-inside", ("BMP", "PNG")),
    ],
)
def test_unsupported_codec_messages_name_the_codec(name, words):
    sample = next(s for s in REFUSED if s.name == name)
    with pytest.raises(InvalidImage) as info:
        decode_image(sample.data, max_image_pixels=LIMIT)
    for word in words:
        assert word in info.value.message


def test_sixteen_bit_with_transparency_is_scaled_like_without():
    # the Issue's case: I;16 + tRNS went through PIL's clipping convert and came out up to 253 levels off
    v = np.array([[0, 1, 300, 1000, 65535, 32896, 40000, 1000]], dtype=np.uint16)
    img = Image.fromarray(v)
    img.info["transparency"] = 1000
    got = np.asarray(to_rgb(img))
    assert got[..., 0].tolist() == [[0, 0, 1, 255, 255, 128, 156, 255]]
    plain = Image.fromarray(v)
    keep = v != 1000
    assert np.array_equal(got[keep], np.asarray(to_rgb(plain))[keep])


@pytest.mark.parametrize("mode", ["I", "F"])
def test_int_and_float_with_transparency(mode):
    values = np.array([[0, 500, 70000, 7, -3]], dtype=np.int32 if mode == "I" else np.float32)
    img = Image.fromarray(values, mode)
    img.info["transparency"] = 7
    expected = scale16(values) if mode == "I" else np.clip(np.round(values.astype(np.float64)), 0, 255)
    expected = np.where(values == 7, 255, expected)
    assert np.array_equal(np.asarray(to_rgb(img)), grey3(expected))


def test_pa_composited_on_white():
    rng = np.random.default_rng(3)
    palette, idx, alpha = (
        rng.integers(0, 256, (256, 3), np.uint8),
        rng.integers(0, 256, (5, 7), np.uint8),
        rng.integers(0, 256, (5, 7), np.uint8),
    )
    p = Image.fromarray(idx, "P")
    p.putpalette(palette.reshape(-1).tolist())
    pa = p.convert("PA")
    pa.putalpha(Image.fromarray(alpha, "L"))
    assert pa.mode == "PA"
    assert np.array_equal(np.asarray(to_rgb(pa)), on_white(palette[idx], alpha))


def _ojpeg_tiff() -> bytes:
    """An 'old-style JPEG' TIFF without its tables: libtiff reports an error while PIL decodes it."""
    from tests.image_corpus import _tiff_with_compression

    return _tiff_with_compression(6)


def test_libtiff_messages_go_to_debug_logging_not_stderr(capfd, caplog):
    from concurrent.futures import ThreadPoolExecutor

    from vitserve import libtiff

    if not libtiff.install_log_handlers():
        pytest.skip("this Pillow's libtiff could not be found in the process")
    caplog.set_level(logging.DEBUG, logger="vitserve.libtiff")
    data = _ojpeg_tiff()

    def decode(_):
        with pytest.raises(InvalidImage):
            decode_image(data, max_image_pixels=LIMIT)

    with ThreadPoolExecutor(4) as pool:  # the API decodes on a pool: the handler must work from any thread
        list(pool.map(decode, range(16)))
    _, err = capfd.readouterr()
    assert "OJPEG" not in err
    assert "JPEG tables" not in err
    records = [r for r in caplog.records if r.name == "vitserve.libtiff"]
    assert len(records) >= 16
    assert all(r.levelno == logging.DEBUG for r in records)
    assert "Missing JPEG tables" in records[0].getMessage()  # formatted from libtiff's printf arguments


def test_pil_error_log_about_a_broken_file_is_demoted(caplog):
    from tests.image_corpus import save

    data = bytearray(save(Image.new("RGB", (4, 4)), "TIFF"))
    ifd = int.from_bytes(data[4:8], "little")
    for i in range(int.from_bytes(data[ifd : ifd + 2], "little")):
        entry = ifd + 2 + 12 * i
        if data[entry : entry + 2] == (277).to_bytes(2, "little"):  # SamplesPerPixel
            data[entry + 8 : entry + 10] = (35).to_bytes(2, "little")
    caplog.set_level(logging.INFO)
    with pytest.raises(InvalidImage):
        decode_image(bytes(data), max_image_pixels=LIMIT)
    assert not [r for r in caplog.records if r.name.startswith("PIL") and r.levelno >= logging.WARNING]
