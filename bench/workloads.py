"""Synthetic-but-photo-like test images, generated (never committed) for the serving and JPEG benchmarks.

A "photo" here is: a smooth low-frequency colour field (a few random gradients upsampled bicubically),
hard-edged shapes (rectangles, ellipses, thin lines — the edges a resize must keep), and per-pixel sensor-like
noise, saved as JPEG quality 90 with 4:2:0 chroma subsampling, like a phone camera. Deterministic per seed.
"""

from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# Real-world photo sizes (width, height): VGA, XGA, 1080p, a 12 MP phone photo in portrait.
MIXED_SIZES: tuple[tuple[int, int], ...] = ((640, 480), (1024, 768), (1920, 1080), (3024, 4032))
LARGE_SIZE = (4000, 3000)  # 12 MP
SMALL_SIZE = (224, 224)
# The front-door benches' sizes: 448 px (256 tokens after Qwen's 2x2 merge of 14 px patches) and 1080p, whose
# 2,700 merged tokens (45 x 60 at 28 px) are the embedding bench/ec_handover.py and bench/inline_body.py hand over.
SIZES: dict[str, tuple[int, int]] = {"448px": (448, 448), "1080p": (1920, 1080)}
TOKENS_1080P = 2700


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image with smooth gradients, sharp edges and noise (see module docstring)."""
    rng = np.random.default_rng(seed)
    base = _smooth_field(width, height, rng)
    _draw_shapes(base, width, height, random.Random(seed))
    return _add_noise(base, rng, sigma=6.0)


def _smooth_field(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    # a coarse random grid upsampled bicubically = smooth gradients at every scale above the grid step
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)  # (h, w, RGB)
    field = Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    return field.filter(ImageFilter.GaussianBlur(radius=max(1, min(width, height) // 200)))


def _draw_shapes(img: Image.Image, width: int, height: int, rnd: random.Random) -> None:
    draw = ImageDraw.Draw(img)
    scale = min(width, height)
    for _ in range(24):
        x0, y0 = rnd.randrange(width), rnd.randrange(height)
        w, h = rnd.randrange(scale // 20 + 1, scale // 3 + 2), rnd.randrange(scale // 20 + 1, scale // 3 + 2)
        colour = (rnd.randrange(256), rnd.randrange(256), rnd.randrange(256))
        if rnd.random() < 0.5:
            draw.rectangle((x0, y0, x0 + w, y0 + h), fill=colour)
        else:
            draw.ellipse((x0, y0, x0 + w, y0 + h), fill=colour)
    for _ in range(40):  # thin lines: the finest detail, what a downscale loses first
        pts = [(rnd.randrange(width), rnd.randrange(height)) for _ in range(2)]
        draw.line(pts, fill=(rnd.randrange(256),) * 3, width=rnd.choice((1, 2, 3)))


def _add_noise(img: Image.Image, rng: np.random.Generator, sigma: float) -> Image.Image:
    arr = np.asarray(img, dtype=np.int16)  # (H, W, 3)
    # one noise tile reused with random offsets per channel keeps 12 MP generation fast
    tile = rng.normal(0.0, sigma, size=(512, 512)).astype(np.int16)  # (512, 512)
    reps = (arr.shape[0] // 512 + 1, arr.shape[1] // 512 + 1)
    noise = np.tile(tile, reps)[: arr.shape[0], : arr.shape[1]]  # (H, W)
    out = np.clip(arr + noise[..., None], 0, 255).astype(np.uint8)  # (H, W, 3)
    return Image.fromarray(out, "RGB")


def gradient_png(width: int, height: int, seed: int) -> bytes:
    """A cheap PNG (gradients and noise, no shapes) for the servers' benches, where the image is only tokens."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)  # (H, W, 3)
    return png_bytes(Image.fromarray(pixels))


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, subsampling=2)  # 4:2:0, as cameras do
    return buf.getvalue()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def photos(size: tuple[int, int], n: int, seed: int = 0) -> list[bytes]:
    """`n` photo-like JPEGs of one size, seeds `seed`, `seed + 1`, ..."""
    return [jpeg_bytes(photo_like(*size, seed + i)) for i in range(n)]


def small_workload(n: int, seed: int = 0) -> list[bytes]:
    """224x224 JPEGs (thumbnails)."""
    return photos(SMALL_SIZE, n, seed)


def mixed_workload(n: int, seed: int = 100) -> list[bytes]:
    """Real-world photo sizes as JPEG, cycling through MIXED_SIZES in a shuffled but fixed order."""
    order = [MIXED_SIZES[i % len(MIXED_SIZES)] for i in range(n)]
    random.Random(seed).shuffle(order)
    return [jpeg_bytes(photo_like(w, h, seed + i)) for i, (w, h) in enumerate(order)]


def large_workload(n: int, seed: int = 200) -> list[bytes]:
    """12 MP (4000x3000) JPEGs."""
    return photos(LARGE_SIZE, n, seed)


WORKLOADS = {"small": small_workload, "mixed": mixed_workload, "large": large_workload}
