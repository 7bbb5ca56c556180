"""Image-making helpers for tests: encoded bytes in every format/mode, crafted headers, EXIF, animations."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def noise(width: int, height: int, *, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A seeded random image (random pixels make resize/normalize differences visible)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "LA": 2, "CMYK": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def encode(img: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int, *, bit_depth: int = 8, color_type: int = 2) -> bytes:
    """A tiny PNG that *declares* width x height but carries (almost) no pixel data: a bomb header."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def with_orientation(img: Image.Image, fmt: str, orientation: int, **save_kwargs) -> bytes:
    """Encode img with an EXIF Orientation tag (0x0112) written by PIL."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, fmt, exif=exif.tobytes(), **save_kwargs)


def animated_gif(frames: int, width: int = 16, height: int = 12) -> tuple[bytes, Image.Image]:
    """(GIF bytes, the first frame in RGB); every frame has its own solid colour."""
    images = [Image.new("RGB", (width, height), ((37 * i) % 256, (91 * i) % 256, 200)) for i in range(frames)]
    data = encode(images[0], "GIF", save_all=True, append_images=images[1:], duration=10, loop=0)
    return data, images[0]


def palette_with_alpha(
    width: int, height: int, *, seed: int = 0
) -> tuple[Image.Image, np.ndarray, np.ndarray]:
    """A "P" image with a per-index tRNS alpha table: (image, palette (256, 3), alpha (256,))."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, size=(256, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, size=256, dtype=np.uint8)
    indices = rng.integers(0, 256, size=(height, width), dtype=np.uint8)
    img = Image.fromarray(indices, "P")
    img.putpalette(palette.flatten().tolist())
    img.info["transparency"] = alpha.tobytes()
    return img, palette, alpha
