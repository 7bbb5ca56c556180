"""Safe image decoding (docs/processing.md): allowlist, header pixel check, EXIF orientation, correct 8-bit RGB.

Order matters: the format and the pixel count are checked from the header (``Image.open`` parses only the
header) before a single pixel is decoded, so a PNG that declares 30000x30000 is refused without allocating.

Colour conversion rules (all end in 8-bit "RGB"):
- alpha (RGBA, LA, PA, RGBa, La, P/L/RGB with a tRNS transparency) is composited on white:
  ``out = round((c * a + 255 * (255 - a)) / 255)``;
- 16-bit greyscale (I;16, I;16B, I;16L, I;16N) is *scaled*, not clipped: ``out = round(v / 257)``, which maps
  0..65535 onto 0..255 exactly (65535 -> 255, 257 * k -> k); mode "I" (32-bit int, what some 16-bit TIFF/PNG
  decoders give) is treated the same way after clipping to 0..65535; 16-bit *colour* PNG/TIFF never reach
  us as 16-bit: PIL's readers keep the high byte (v >> 8, at most 1 below round(v / 257));
- "F" (32-bit float) is read as 0..1 when every finite value lies there, else as 0..255 (PIL's convention),
  clipped; NaN becomes 0;
- CMYK uses PIL's conversion ``R = round((255 - C) * (255 - K) / 255)`` (no ICC colour management; Adobe's
  inverted CMYK JPEGs are already un-inverted by PIL's JPEG reader);
- 1-bit, L, P, YCbCr and the rest use PIL's ``convert("RGB")``.
Animations: only the first frame is decoded (``seek(0)``; frames are never iterated).
No image bytes ever go into a message or a log line.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vitserve.errors import InvalidImage, PayloadTooLarge, VitserveError

# PIL's names for the allowed formats (docs/processing.md); Image.open is told to try only these.
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# Our --max_image_pixels check is the one that decides; PIL's own global bomb limit (89.5 MP, error at 2x)
# would otherwise refuse images a user allowed, or warn on ones we accept. This is process-global on purpose.
Image.MAX_IMAGE_PIXELS = None

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})


@dataclass(frozen=True)
class DecodedImage:
    """A decoded image: mode "RGB", EXIF orientation applied, first frame only."""

    image: Image.Image
    original_size: tuple[int, int]  # (width, height) after EXIF orientation
    format: str  # PIL format name, e.g. "JPEG"
    draft_scale: int = 1  # 1 = full decode; 2/4/8 = JPEG decoded at 1/scale, then resized to the target


# (width, height) after EXIF orientation -> the (width, height) the processor will resize it to, or None
# when no reduced decode should be tried (see vitserve.jpeg_draft.JpegDraft).
DraftTarget = Callable[[int, int], "tuple[int, int] | None"]
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that transpose width and height


def decode_image(data: bytes, *, max_image_pixels: int, draft_target: DraftTarget | None = None) -> DecodedImage:
    """Decode untrusted bytes into an RGB PIL image.

    Raises InvalidImage (not an image, a format outside the allowlist, truncated or corrupt data) or
    PayloadTooLarge (width x height above ``max_image_pixels``, read from the header before decoding).

    ``draft_target`` (--jpeg_draft): for a JPEG whose planned resize target is at most half its size, libjpeg
    decodes at the largest scale 1/2, 1/4 or 1/8 that still is >= the target in both sides, and the result
    is resized to exactly the target with the same bicubic filter the processors use, so the processor then
    plans the same grid. ``original_size`` stays the full size from the header.
    """
    if not data:
        raise InvalidImage("empty image data")
    img = _open_header(data)
    fmt = str(img.format)
    _check_pixels(img.size, max_image_pixels)
    try:
        draft = _apply_draft(img, draft_target) if draft_target is not None and fmt == "JPEG" else None
        rgb = _decode_first_frame(img)
    finally:
        img.close()
    if draft is None:
        return DecodedImage(image=rgb, original_size=rgb.size, format=fmt)
    target, original, scale = draft
    resized = rgb.resize(target, resample=Image.Resampling.BICUBIC)  # the processors' filter (HF's resample)
    rgb.close()
    return DecodedImage(image=resized, original_size=original, format=fmt, draft_scale=scale)


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block: exif_transpose will ignore it too
        return 1


def _oriented_size(img: Image.Image, size: tuple[int, int]) -> tuple[int, int]:
    return (size[1], size[0]) if _orientation(img) in _SWAPS_AXES else size


def _apply_draft(
    img: Image.Image, draft_target: DraftTarget
) -> tuple[tuple[int, int], tuple[int, int], int] | None:
    """Ask libjpeg for a reduced decode; returns (target size, original oriented size, scale) or None."""
    original = _oriented_size(img, img.size)
    target = draft_target(*original)
    if target is None:
        return None
    stored_target = _oriented_size(img, target)  # the draft works on the stored (unrotated) axes
    if min(img.size[0] // stored_target[0], img.size[1] // stored_target[1]) < 2:
        return None  # no scale >= 2 keeps both sides at or above the target
    before = img.size
    try:
        img.draft(img.mode, stored_target)  # PIL picks s in (8, 4, 2) with ceil(side / s) >= target side
    except Exception as exc:
        raise InvalidImage(f"corrupt JPEG header ({type(exc).__name__})") from exc
    if img.size == before:
        return None  # PIL declined (e.g. a JPEG with several tiles)
    scale = max(2, round(before[0] / img.size[0]))  # sides are ceil(side / s), so this rounds back to s
    return (int(target[0]), int(target[1])), original, scale


def _open_header(data: bytes) -> Image.Image:
    """Parse the header only; identify the format among the allowlist."""
    # No warnings.catch_warnings() here: it swaps process-global filters and is not thread-safe; with
    # MAX_IMAGE_PIXELS = None PIL emits no bomb warning anyway.
    try:
        return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as exc:
        # Only reachable if someone re-armed PIL's global limit; still a size problem, not corrupt data.
        raise PayloadTooLarge(
            "image pixel count is over PIL's decompression-bomb limit; see --max_image_pixels"
        ) from exc
    except UnidentifiedImageError as exc:
        raise InvalidImage(
            f"not an image, or a format outside the allowlist ({', '.join(ALLOWED_FORMATS)})"
        ) from exc
    except Exception as exc:
        # PIL plugins raise SyntaxError, struct.error, ValueError, OSError... on bad headers
        raise InvalidImage(f"corrupt image header ({type(exc).__name__})") from exc


def _check_pixels(size: tuple[int, int], max_image_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidImage(f"image has an empty size {width}x{height}")
    if max_image_pixels > 0 and width * height > max_image_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_image_pixels} "
            "set by --max_image_pixels"
        )


def _decode_first_frame(img: Image.Image) -> Image.Image:
    """Decode frame 0, apply EXIF orientation, convert to RGB; every PIL failure becomes InvalidImage."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # Someone in this process switched on PIL's "accept truncated data" mode; refuse rather than
        # silently encode half an image.
        raise InvalidImage("refusing to decode: PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on in this process")
    try:
        img.seek(0)
        img.load()
        oriented = ImageOps.exif_transpose(img)
        return to_rgb(oriented)
    except VitserveError:
        raise
    except Exception as exc:  # truncated/corrupt streams raise OSError, SyntaxError, zlib.error, EOFError...
        raise InvalidImage(f"truncated or corrupt image data ({type(exc).__name__})") from exc


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB by the rules in the module docstring."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img.copy()
    if mode in _ALPHA_MODES or "transparency" in img.info:
        return _composite_on_white(img.convert("RGBA"))
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        return _grey_to_rgb(_scale_16bit(np.asarray(img)))
    if mode == "F":
        return _grey_to_rgb(_scale_float(np.asarray(img, dtype=np.float64)))
    return img.convert("RGB")


def _composite_on_white(rgba: Image.Image) -> Image.Image:
    # PIL's masked paste computes round((c*a + 255*(255-a)) / 255) exactly (checked over all 256x256 (c, a)
    # pairs in tests/unit/test_images.py) in C, without numpy temporaries for a 50 MP image
    out = Image.new("RGB", rgba.size, (255, 255, 255))
    out.paste(rgba.convert("RGB"), mask=rgba.getchannel("A"))
    return out


_ROWS_PER_CHUNK = 512  # bounds the integer temporaries to a few MB per chunk even for 50 MP images


def _scale_16bit(values: np.ndarray) -> np.ndarray:
    out = np.empty(values.shape, dtype=np.uint8)  # (H, W)
    for start in range(0, values.shape[0], _ROWS_PER_CHUNK):
        v = np.clip(values[start : start + _ROWS_PER_CHUNK].astype(np.int64), 0, 65535)
        out[start : start + _ROWS_PER_CHUNK] = (v + 128) // 257  # round(v / 257); no tie since 257 is odd
    return out


def _scale_float(values: np.ndarray) -> np.ndarray:
    finite = values[np.isfinite(values)]
    scale = 255.0 if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0 else 1.0
    v = np.nan_to_num(values * scale, nan=0.0, posinf=255.0, neginf=0.0)
    return np.clip(np.rint(v), 0, 255).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1), "RGB")  # (H, W) -> (H, W, 3)
