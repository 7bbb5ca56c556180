"""A corpus of real-world-like and broken image files, each with the answer docs/processing.md promises.

Every expected pixel array here is computed with numpy from the raw samples this module wrote (or, for lossy
JPEG, from PIL's plain decode of the stored pixels before any vitserve rule), never by vitserve's decoder.
Used by tests/unit/test_decode_rules.py (pixels, at the decode_image level) and tests/e2e/test_image_corpus.py
(status codes and sizes over real HTTP).
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vitserve import libtiff


@dataclass(frozen=True)
class Sample:
    name: str
    data: bytes
    size: tuple[int, int] | None = None  # (width, height) after EXIF orientation; None for a refused file
    rgb: np.ndarray | None = (
        None  # exact expected pixels (H, W, 3) uint8; None where only status/size are checked
    )
    code: str | None = None  # the expected error code; None means 200
    status: int = 200


# --- numpy references: the rules of docs/processing.md, written independently ----------------------------


def on_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """round((c * a + 255 * (255 - a)) / 255) in exact integers (255 is odd: no ties)."""
    c = colour.astype(np.int64)
    a = alpha.astype(np.int64)[..., None]
    return ((c * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def grey3(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey.astype(np.uint8)[..., None], 3, axis=-1)


def scale16(values: np.ndarray) -> np.ndarray:
    return np.round(np.clip(values.astype(np.float64), 0, 65535) / 257.0).astype(np.uint8)


def cmyk_to_rgb(cmyk: np.ndarray) -> np.ndarray:
    c = cmyk.astype(np.float64)
    return np.round((255.0 - c[..., :3]) * (255.0 - c[..., 3:4]) / 255.0).astype(np.uint8)


def orient(stored: np.ndarray, orientation: int) -> np.ndarray:
    """What a viewer shows for EXIF orientation 1-8 of the stored (H, W, C) pixels."""
    transforms = {
        1: lambda a: a,
        2: lambda a: a[:, ::-1],
        3: lambda a: np.rot90(a, 2),
        4: lambda a: a[::-1],
        5: lambda a: a.transpose(1, 0, 2),
        6: lambda a: np.rot90(a, -1),
        7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
        8: lambda a: np.rot90(a, 1),
    }
    return np.ascontiguousarray(transforms[orientation](stored))


# --- writers -------------------------------------------------------------------------------------------


def chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def raw_png(samples: np.ndarray, color_type: int, bit_depth: int, *chunks: bytes, size=None) -> bytes:
    """A PNG written byte by byte from raw samples (filter 0): (H, W) or (H, W, C), big-endian 16-bit."""
    h, w = samples.shape[:2]
    rows = []
    for row in samples:
        if bit_depth == 16:
            raw = row.astype(">u2").tobytes()
        elif bit_depth == 8:
            raw = row.astype(np.uint8).tobytes()
        else:  # 1/2/4-bit greyscale or palette: pack MSB first
            bits = np.unpackbits(row.astype(np.uint8)[:, None], axis=1)[:, 8 - bit_depth :]
            raw = np.packbits(bits.reshape(-1)).tobytes()
        rows.append(b"\0" + raw)
    width, height = size or (w, h)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + b"".join(chunks)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


_rng = np.random.default_rng


def _u8(rng, *shape) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _ok(name: str, data: bytes, rgb: np.ndarray | None, size=None) -> Sample:
    if size is None:
        size = (rgb.shape[1], rgb.shape[0])
    return Sample(name, data, size=size, rgb=rgb)


# --- valid files ----------------------------------------------------------------------------------------


def png_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed)
    bits = rng.integers(0, 2, size=(h, w), dtype=np.uint8)
    yield _ok(f"png-1bit-{seed}", raw_png(bits, 0, 1), grey3(bits * 255))
    for depth, step in ((2, 85), (4, 17)):
        raw = rng.integers(0, 1 << depth, size=(h, w), dtype=np.uint8)
        yield _ok(f"png-L{depth}-{seed}", raw_png(raw, 0, depth), grey3(raw * step))
        key = int(raw[0, 0])
        trns = chunk(b"tRNS", struct.pack(">H", key))
        yield _ok(
            f"png-L{depth}-trns-{seed}",
            raw_png(raw, 0, depth, trns),
            grey3(np.where(raw == key, 255, raw * step)),
        )
    grey = _u8(rng, h, w)
    yield _ok(f"png-L-{seed}", raw_png(grey, 0, 8), grey3(grey))
    key = int(grey[0, 0])
    yield _ok(
        f"png-L-trns-{seed}",
        raw_png(grey, 0, 8, chunk(b"tRNS", struct.pack(">H", key))),
        grey3(np.where(grey == key, 255, grey)),
    )
    la = _u8(rng, h, w, 2)
    yield _ok(f"png-LA-{seed}", raw_png(la, 4, 8), on_white(grey3(la[..., 0]), la[..., 1]))
    rgb = _u8(rng, h, w, 3)
    yield _ok(f"png-RGB-{seed}", raw_png(rgb, 2, 8), rgb)
    key3 = rgb[0, 0].astype(int)
    trns = chunk(b"tRNS", struct.pack(">HHH", *key3))
    yield _ok(
        f"png-RGB-trns-{seed}",
        raw_png(rgb, 2, 8, trns),
        np.where((rgb == key3).all(-1, keepdims=True), 255, rgb).astype(np.uint8),
    )
    rgba = _u8(rng, h, w, 4)
    yield _ok(f"png-RGBA-{seed}", raw_png(rgba, 6, 8), on_white(rgba[..., :3], rgba[..., 3]))
    palette, alpha = _u8(rng, 256, 3), _u8(rng, 256)
    idx = _u8(rng, h, w)
    plte = chunk(b"PLTE", palette.tobytes())
    yield _ok(f"png-P-{seed}", raw_png(idx, 3, 8, plte), palette[idx])
    yield _ok(
        f"png-P-trns-{seed}",
        raw_png(idx, 3, 8, plte, chunk(b"tRNS", alpha.tobytes())),
        on_white(palette[idx], alpha[idx]),
    )
    small = rng.integers(0, 16, size=(h, w), dtype=np.uint8)  # 4-bit palette, shorter tRNS table
    short_alpha = _u8(rng, 9)
    full_alpha = np.concatenate([short_alpha, np.full(256 - 9, 255, np.uint8)])
    yield _ok(
        f"png-P4-trns-{seed}",
        raw_png(small, 3, 4, chunk(b"PLTE", palette[:16].tobytes()), chunk(b"tRNS", short_alpha.tobytes())),
        on_white(palette[small], full_alpha[small]),
    )


def png16_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed + 1000)
    v16 = rng.integers(0, 65536, size=(h, w), dtype=np.uint16)
    v16[0, :3] = [0, 65535, 32896]
    yield _ok(f"png-I16-{seed}", raw_png(v16, 0, 16), grey3(scale16(v16)))
    key = int(v16[h // 2, w // 2])
    yield _ok(
        f"png-I16-trns-{seed}",
        raw_png(v16, 0, 16, chunk(b"tRNS", struct.pack(">H", key))),
        grey3(np.where(v16 == key, 255, scale16(v16))),
    )
    low = rng.integers(0, 1024, size=(h, w), dtype=np.uint16)  # dark 16-bit: the case clipping ruins
    key = int(low[0, 0])
    yield _ok(
        f"png-I16-dark-trns-{seed}",
        raw_png(low, 0, 16, chunk(b"tRNS", struct.pack(">H", key))),
        grey3(np.where(low == key, 255, scale16(low))),
    )
    c16 = rng.integers(0, 65536, size=(h, w, 3), dtype=np.uint16)
    yield _ok(f"png-RGB16-{seed}", raw_png(c16, 2, 16), (c16 >> 8).astype(np.uint8))
    c16a = rng.integers(0, 65536, size=(h, w, 4), dtype=np.uint16)
    yield _ok(f"png-RGBA16-{seed}", raw_png(c16a, 6, 16), on_white(c16a[..., :3] >> 8, c16a[..., 3] >> 8))
    la16 = rng.integers(0, 65536, size=(h, w, 2), dtype=np.uint16)
    yield _ok(f"png-LA16-{seed}", raw_png(la16, 4, 16), on_white(grey3(la16[..., 0] >> 8), la16[..., 1] >> 8))


def exif_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed)
    stored = _u8(rng, h, w, 3)
    photo = Image.fromarray(stored)
    for o in range(1, 9):
        yield _ok(f"png-exif{o}-{seed}", save(photo, "PNG", exif=exif_bytes(o)), orient(stored, o))
        yield _ok(f"tiff-exif{o}-{seed}", save(photo, "TIFF", exif=exif_bytes(o)), orient(stored, o))
        for progressive in (False, True):
            data = save(photo, "JPEG", quality=90, progressive=progressive, exif=exif_bytes(o))
            plain = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # PIL's decode, not rotated
            yield _ok(f"jpeg-exif{o}-{'prog' if progressive else 'base'}-{seed}", data, orient(plain, o))


def jpeg_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed)
    rgb = Image.fromarray(_u8(rng, h, w, 3))
    for name, kw in (
        ("base", {}),
        ("prog", {"progressive": True}),
        ("444", {"subsampling": 0}),
        ("opt", {"optimize": True, "quality": 40}),
    ):
        yield _ok(f"jpeg-{name}-{seed}", save(rgb, "JPEG", **kw), None, size=(w, h))
    grey = save(Image.fromarray(_u8(rng, h, w)), "JPEG")
    yield _ok(f"jpeg-grey-{seed}", grey, grey3(np.asarray(Image.open(io.BytesIO(grey)))))
    cmyk = save(Image.fromarray(_u8(rng, h, w, 4), "CMYK"), "JPEG", quality=95)
    stored = np.asarray(Image.open(io.BytesIO(cmyk)))  # PIL's CMYK samples (Adobe inversion undone)
    yield _ok(f"jpeg-CMYK-{seed}", cmyk, cmyk_to_rgb(stored))


def webp_gif_bmp_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed)
    rgb, rgba = _u8(rng, h, w, 3), _u8(rng, h, w, 4)
    yield _ok(f"webp-lossy-{seed}", save(Image.fromarray(rgb), "WEBP", quality=80), None, size=(w, h))
    yield _ok(f"webp-lossless-{seed}", save(Image.fromarray(rgb), "WEBP", lossless=True), rgb)
    yield _ok(
        f"webp-alpha-{seed}",
        save(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True, exact=True),
        on_white(rgba[..., :3], rgba[..., 3]),
    )
    yield _ok(
        f"webp-lossy-alpha-{seed}", save(Image.fromarray(rgba, "RGBA"), "WEBP", quality=70), None, size=(w, h)
    )
    frames = [_u8(rng, h, w, 3) for _ in range(3)]
    yield _ok(
        f"webp-animated-{seed}",
        save(
            Image.fromarray(frames[0]),
            "WEBP",
            lossless=True,
            save_all=True,
            append_images=[Image.fromarray(f) for f in frames[1:]],
        ),
        frames[0],
    )
    palette = _u8(rng, 8, 3)
    idx = rng.integers(0, 8, size=(h, w), dtype=np.uint8)
    gif_frames = []
    for shift in range(3):
        frame = Image.fromarray((idx + shift) % 8, "P")
        frame.putpalette(palette.reshape(-1).tolist())
        gif_frames.append(frame)
    yield _ok(
        f"gif-animated-{seed}",
        save(gif_frames[0], "GIF", save_all=True, append_images=gif_frames[1:], duration=20, loop=0),
        palette[idx],
    )
    see_through = Image.fromarray(idx, "P")
    see_through.putpalette(palette.reshape(-1).tolist())
    yield _ok(
        f"gif-transparent-{seed}",
        save(see_through, "GIF", transparency=3),
        np.where((idx == 3)[..., None], 255, palette[idx]).astype(np.uint8),
    )
    yield _ok(f"bmp-RGB-{seed}", save(Image.fromarray(rgb), "BMP"), rgb)
    grey = _u8(rng, h, w)
    yield _ok(f"bmp-L-{seed}", save(Image.fromarray(grey), "BMP"), grey3(grey))
    bits = rng.integers(0, 2, size=(h, w)).astype(bool)
    yield _ok(f"bmp-1bit-{seed}", save(Image.fromarray(bits), "BMP"), grey3(bits.astype(np.uint8) * 255))
    yield _ok(f"bmp-P-{seed}", save(see_through.copy(), "BMP"), palette[idx])


def tiff_samples(seed: int, w: int, h: int) -> Iterator[Sample]:
    rng = _rng(seed)
    rgb, cmyk, la = _u8(rng, h, w, 3), _u8(rng, h, w, 4), _u8(rng, h, w, 2)
    for comp in ("raw", "tiff_lzw", "tiff_adobe_deflate", "packbits", "lzma", "zstd"):
        if comp != "raw" and not libtiff.codec_configured(
            {"tiff_lzw": 5, "tiff_adobe_deflate": 8, "packbits": 32773, "lzma": 34925, "zstd": 50000}[comp]
        ):
            continue
        yield _ok(f"tiff-RGB-{comp}-{seed}", save(Image.fromarray(rgb), "TIFF", compression=comp), rgb)
        yield _ok(
            f"tiff-CMYK-{comp}-{seed}",
            save(Image.fromarray(cmyk, "CMYK"), "TIFF", compression=comp),
            cmyk_to_rgb(cmyk),
        )
    yield _ok(f"tiff-jpeg-{seed}", save(Image.fromarray(rgb), "TIFF", compression="jpeg"), None, size=(w, h))
    yield _ok(
        f"tiff-LA-{seed}", save(Image.fromarray(la, "LA"), "TIFF"), on_white(grey3(la[..., 0]), la[..., 1])
    )
    rgba = _u8(rng, h, w, 4)
    yield _ok(
        f"tiff-RGBA-{seed}",
        save(Image.fromarray(rgba, "RGBA"), "TIFF"),
        on_white(rgba[..., :3], rgba[..., 3]),
    )
    bits = rng.integers(0, 2, size=(h, w)).astype(bool)
    yield _ok(
        f"tiff-1bit-g4-{seed}",
        save(Image.fromarray(bits), "TIFF", compression="group4"),
        grey3(bits.astype(np.uint8) * 255),
    )
    v16 = rng.integers(0, 65536, size=(h, w), dtype=np.uint16)
    yield _ok(f"tiff-I16-{seed}", save(Image.fromarray(v16), "TIFF"), grey3(scale16(v16)))
    yield _ok(
        f"tiff-I16-lzw-{seed}",
        save(Image.fromarray(v16), "TIFF", compression="tiff_lzw"),
        grey3(scale16(v16)),
    )
    i32 = rng.integers(-1000, 70000, size=(h, w), dtype=np.int32)
    yield _ok(f"tiff-I32-{seed}", save(Image.fromarray(i32, "I"), "TIFF"), grey3(scale16(i32)))
    unit = rng.random(size=(h, w), dtype=np.float32)
    yield _ok(
        f"tiff-F-unit-{seed}",
        save(Image.fromarray(unit, "F"), "TIFF"),
        grey3(np.round(unit.astype(np.float64) * 255.0)),
    )
    wide = rng.uniform(-50, 300, size=(h, w)).astype(np.float32)
    wide[0, 0] = np.nan
    expected = np.clip(np.round(np.nan_to_num(wide.astype(np.float64), nan=0.0)), 0, 255)
    yield _ok(f"tiff-F-wide-{seed}", save(Image.fromarray(wide, "F"), "TIFF"), grey3(expected))
    pages = [Image.fromarray(_u8(rng, h, w, 3)) for _ in range(3)]
    yield _ok(
        f"tiff-multipage-{seed}",
        save(pages[0], "TIFF", save_all=True, append_images=pages[1:]),
        np.asarray(pages[0]),
    )


def valid_samples(seeds: range, sizes: tuple[tuple[int, int], ...] = ((23, 17),)) -> list[Sample]:
    out: list[Sample] = []
    for seed in seeds:
        w, h = sizes[seed % len(sizes)]
        for gen in (
            png_samples,
            png16_samples,
            exif_samples,
            jpeg_samples,
            webp_gif_bmp_samples,
            tiff_samples,
        ):
            out.extend(gen(seed, w, h))
    return out


# --- refused files --------------------------------------------------------------------------------------


def _tiff_with_compression(scheme: int) -> bytes:
    """A little-endian RGB TIFF whose Compression tag says ``scheme`` (the strip is whatever bytes follow)."""
    data = bytearray(save(Image.new("RGB", (8, 8), (10, 20, 30)), "TIFF"))
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * i
        if struct.unpack_from("<H", data, entry)[0] == 259:
            struct.pack_into("<H", data, entry + 8, scheme)
    return bytes(data)


def _patched(data: bytes, offset: int, layout: str, *values: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(layout, out, offset, *values)
    return bytes(out)


def _jpeg_with_size(width: int, height: int) -> bytes:
    data = save(Image.new("RGB", (16, 16)), "JPEG")
    return _patched(data, data.index(b"\xff\xc0") + 5, ">HH", height, width)


def _webp_with_size(width: int, height: int) -> bytes:
    """A lossless WebP whose VP8L header declares width x height (14 bits each) around a tiny bitstream."""
    data = bytearray(save(Image.new("RGB", (8, 8)), "WEBP", lossless=True))
    assert data[12:16] == b"VP8L"
    assert data[20] == 0x2F
    bits = int.from_bytes(data[21:25], "little")
    bits = (bits & ~((1 << 28) - 1)) | (width - 1) | ((height - 1) << 14)
    data[21:25] = bits.to_bytes(4, "little")
    return bytes(data)


def refused_samples() -> list[Sample]:
    bad: list[Sample] = []

    def refuse(name: str, data: bytes, code: str, status: int = 400) -> None:
        bad.append(Sample(name, data, code=code, status=status))

    rgb = Image.fromarray(_u8(_rng(99), 40, 50, 3))
    for fmt in ("ICO", "PPM", "TGA", "PCX", "SGI", "QOI", "JPEG2000", "DDS", "AVIF", "PDF"):
        try:
            refuse(f"outside-allowlist-{fmt}", save(rgb.convert("RGB"), fmt), "invalid_image")
        except (KeyError, OSError, ValueError):  # a Pillow built without that writer
            continue
    for fmt, kw in (
        ("PNG", {}),
        ("JPEG", {}),
        ("WEBP", {"lossless": True}),
        ("GIF", {}),
        ("BMP", {}),
        ("TIFF", {}),
        ("WEBP", {"quality": 80}),
    ):
        data = save(rgb, fmt, **kw)
        for cut in (0.5, 0.9):
            refuse(f"truncated-{fmt}-{kw}-{cut}", data[: int(len(data) * cut)], "invalid_image")
        refuse(f"header-only-{fmt}-{kw}", data[:40], "invalid_image")
    refuse("zero-bytes-garbage", b"\0" * 64, "invalid_image")
    refuse("png-zero-width", raw_png(np.zeros((4, 4), np.uint8), 0, 8, size=(0, 4)), "invalid_image")
    refuse("text", b"hello, this is not an image", "invalid_image")
    refuse("svg", b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "invalid_image")
    refuse("html-with-png-inside", b"<html>" + save(rgb, "PNG") + b"</html>", "invalid_image")
    refuse("pdf-with-jpeg-inside", b"%PDF-1.4\n" + save(rgb, "JPEG"), "invalid_image")
    for name, data in (
        ("png", raw_png(np.zeros((2, 2), np.uint8), 0, 8, size=(30000, 30000))),
        ("png-16bit", raw_png(np.zeros((2, 2), np.uint16), 0, 16, size=(65535, 65535))),
        ("jpeg", _jpeg_with_size(60000, 60000)),
        ("gif", _patched(save(Image.new("P", (8, 8)), "GIF"), 6, "<HH", 65535, 65535)),
        ("bmp", _patched(save(Image.new("RGB", (8, 8)), "BMP"), 18, "<ii", 50000, 50000)),
        ("webp", _webp_with_size(16000, 16000)),
    ):
        refuse(f"bomb-header-{name}", data, "payload_too_large", 413)
    refuse("huge-aspect", raw_png(np.zeros((1, 3000), np.uint8), 0, 8), "aspect_ratio_too_large")
    for scheme, codec in ((50001, "webp"), (34887, "34887"), (50002, "50002"), (34661, "34661")):
        refuse(f"tiff-codec-{codec}", _tiff_with_compression(scheme), "unsupported_image")
    for code, codec in ((4, "jpeg"), (5, "png")):  # BI_JPEG, BI_PNG
        refuse(
            f"bmp-{codec}-inside",
            _patched(save(Image.new("RGB", (8, 8)), "BMP"), 30, "<I", code),
            "unsupported_image",
        )
    c16 = np.zeros((4, 4, 3), np.uint16)
    refuse(
        "png-RGB16-trns",
        raw_png(c16, 2, 16, chunk(b"tRNS", struct.pack(">HHH", 0, 0, 0))),
        "unsupported_image",
    )
    return bad


def polyglot_samples() -> list[Sample]:
    """Valid images with something else appended: they decode as the image."""
    rgb = _u8(_rng(7), 12, 10, 3)
    png = raw_png(rgb, 2, 8)
    gif_idx = np.zeros((12, 10), np.uint8)
    gif = Image.fromarray(gif_idx, "P")
    gif.putpalette([200, 100, 50] * 256)
    return [
        _ok("polyglot-png-plus-zip", png + b"PK\x03\x04" + b"\0" * 100, rgb),
        _ok("polyglot-png-plus-html", png + b"<script>alert(1)</script>", rgb),
        _ok(
            "polyglot-gif-plus-js",
            save(gif, "GIF") + b"*/=1;alert(1)//",
            np.full((12, 10, 3), (200, 100, 50), np.uint8),
        ),
    ]


def flipped(samples: list[Sample], count: int, seed: int = 0) -> list[Sample]:
    """Bit-flipped copies: any documented outcome is fine (see the tests), only never a 5xx."""
    rng = _rng(seed)
    out = []
    for i in range(count):
        base = samples[i % len(samples)]
        data = bytearray(base.data)
        for pos in rng.integers(0, len(data), size=4):
            data[pos] ^= 1 << int(rng.integers(0, 8))
        out.append(Sample(f"flipped-{base.name}-{i}", bytes(data), code="any", status=0))
    return out
