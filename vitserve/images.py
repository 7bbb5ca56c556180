"""Safe image decoding (docs/processing.md): allowlist, header pixel check, EXIF orientation, correct 8-bit RGB.

Order matters: the format and the pixel count are checked from the header (``Image.open`` parses only the
header) before a single pixel is decoded, so a PNG that declares 30000x30000 is refused without allocating.

Colour conversion rules (all end in 8-bit "RGB"):
- alpha (RGBA, LA, PA, RGBa, La, P/1/L/RGB with a tRNS transparency) is composited on white:
  ``out = round((c * a + 255 * (255 - a)) / 255)``; a 2- or 4-bit greyscale PNG's tRNS value is a raw
  sample, so it is scaled like the samples (x85, x17) before it is compared;
- 16-bit greyscale (I;16, I;16B, I;16L, I;16N) is *scaled*, not clipped: ``out = round(v / 257)``, which maps
  0..65535 onto 0..255 exactly (65535 -> 255, 257 * k -> k); mode "I" (32-bit int, what some 16-bit TIFF/PNG
  decoders give) is treated the same way after clipping to 0..65535; 16-bit *colour* PNG/TIFF never reach
  us as 16-bit: PIL's readers keep the high byte (v >> 8, at most 1 below round(v / 257)); a 16-bit colour
  PNG with a tRNS colour key is refused as unsupported (the key is 16-bit, the pixels PIL gives are not);
- "F" (32-bit float) is read as 0..1 when every finite value lies there, else as 0..255 (PIL's convention),
  clipped; NaN becomes 0;
- I;16, I and F with a tRNS value: the scaled grey, and white (255) wherever the raw sample equals the value
  (PIL's own convert clips these modes to 0..255 first: up to 253 levels off);
- CMYK uses PIL's conversion ``R = round((255 - C) * (255 - K) / 255)`` (no ICC colour management; Adobe's
  inverted CMYK JPEGs are already un-inverted by PIL's JPEG reader);
- 1-bit, L, P, YCbCr and the rest use PIL's ``convert("RGB")``.
Animations: only the first frame is decoded (``seek(0)``; frames are never iterated).
Codecs: a TIFF compression this build's libtiff lacks (WebP-in-TIFF in Pillow's wheels; LERC, JPEG XL, JBIG
and any scheme PIL does not know) and a BMP holding JPEG or PNG data are refused as UnsupportedImage, named,
from the header. libtiff's warnings go to the ``vitserve.libtiff`` logger at DEBUG, not to stderr
(vitserve/libtiff.py).
No image bytes ever go into a message or a log line.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps, TiffImagePlugin, UnidentifiedImageError

from vitserve import libtiff
from vitserve.errors import InvalidImage, PayloadTooLarge, UnsupportedImage, VitserveError

# PIL's names for the allowed formats (docs/processing.md); Image.open is told to try only these.
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# Our --max_image_pixels check is the one that decides; PIL's own global bomb limit (89.5 MP, error at 2x)
# would otherwise refuse images a user allowed, or warn on ones we accept. This is process-global on purpose.
Image.MAX_IMAGE_PIXELS = None
libtiff.install_log_handlers()  # libtiff's stderr chatter -> logging at DEBUG (thread-safe; see the module)
# PIL's plugins also warnings.warn() about damaged metadata ("Corrupt EXIF data", odd TIFF tags): one line of
# stderr per call site, about a client's file. Installed once here; catch_warnings() per call would not be
# thread-safe. The decode still succeeds or fails with a typed error, which is what the client sees.
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")


class _DemoteToDebug(logging.Filter):
    """PIL's plugins log some broken client files at ERROR (TIFF: "More samples per pixel than can be
    decoded"), then raise; the client gets a 400 and the server has nothing to fix. Such records become DEBUG,
    dropped unless DEBUG is on for that logger. (Filters run on the logger that made the record, so each
    plugin's logger gets one.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


for _name in (
    "Image",
    "ImageFile",
    "JpegImagePlugin",
    "PngImagePlugin",
    "WebPImagePlugin",
    "GifImagePlugin",
    "BmpImagePlugin",
    "TiffImagePlugin",
):
    logging.getLogger(f"PIL.{_name}").addFilter(_DemoteToDebug())

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_TIFF_MAGIC = {b"II*\0": 8, b"MM\0*": 8, b"II+\0": 16, b"MM\0+": 16}  # -> header length (classic, BigTIFF)
# TIFF compression schemes PIL does not know at all, by the name their users would recognise
_OTHER_TIFF_CODECS = {
    34661: "JBIG",
    34712: "JPEG 2000",
    34887: "LERC",
    34892: "lossy JPEG (DNG)",
    50002: "JPEG XL",
    52546: "JPEG XL (DNG)",
}
_BMP_CODECS = {4: "JPEG", 5: "PNG"}  # BITMAPINFOHEADER compression values PIL cannot decode
_PNG_LOW_BIT_SCALE = {"L;2": 85, "L;4": 17}  # PIL scales 2/4-bit grey samples by these; tRNS stays raw


@dataclass(frozen=True)
class DecodedImage:
    """A decoded image: mode "RGB", EXIF orientation applied, first frame only."""

    image: Image.Image
    original_size: tuple[int, int]  # (width, height) after EXIF orientation
    format: str  # PIL format name, e.g. "JPEG"
    draft_scale: int = 1  # 1 = full decode; 2/4/8 = JPEG decoded at 1/scale, then resized to the target


# (width, height) after EXIF orientation -> the (width, height) the processor will resize it to, or None
# when no reduced decode should be tried (see vitserve.processors.draft.JpegDraft).
DraftTarget = Callable[[int, int], "tuple[int, int] | None"]
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that transpose width and height


def decode_image(
    data: bytes, *, max_image_pixels: int, draft_target: DraftTarget | None = None
) -> DecodedImage:
    """Decode untrusted bytes into an RGB PIL image.

    Raises InvalidImage (not an image, a format outside the allowlist, truncated or corrupt data),
    UnsupportedImage (a codec this build lacks, named) or PayloadTooLarge (width x height above
    ``max_image_pixels``, read from the header before decoding).

    ``draft_target`` (--jpeg_draft): for a JPEG whose planned resize target is at most half its size, libjpeg
    decodes at the largest scale 1/2, 1/4 or 1/8 that still is >= the target in both sides, and the result
    is resized to exactly the target with the same bicubic filter the processors use, so the processor then
    plans the same grid. ``original_size`` stays the full size from the header.
    """
    if not data:
        raise InvalidImage("empty image data")
    img = _open_header(data)
    fmt = str(img.format)
    try:
        _check_pixels(img.size, max_image_pixels)
        _check_codec(img)
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
        _refuse_unknown_codec(data)
        raise InvalidImage(
            f"not an image, or a format outside the allowlist ({', '.join(ALLOWED_FORMATS)})"
        ) from exc
    except Exception as exc:
        # PIL plugins raise SyntaxError, struct.error, ValueError, OSError... on bad headers
        _refuse_unknown_codec(data)
        raise InvalidImage(f"corrupt image header ({type(exc).__name__})") from exc


def _refuse_unknown_codec(data: bytes) -> None:
    """PIL could not open the header: raise UnsupportedImage if that is a codec it lacks, not corruption."""
    header = _TIFF_MAGIC.get(data[:4])
    if header is not None and len(data) >= header:
        try:
            ifd = TiffImagePlugin.ImageFileDirectory_v2(data[:header])
            stream = io.BytesIO(data)
            stream.seek(ifd.next)
            ifd.load(stream)
            scheme = int(ifd.get(259, 1))  # Compression
        except Exception:
            return  # a broken IFD: corrupt, not unsupported
        if scheme not in TiffImagePlugin.COMPRESSION_INFO:
            name = _OTHER_TIFF_CODECS.get(scheme, "unknown")
            raise UnsupportedImage(f"TIFF compression {name!r} (scheme {scheme}) is not supported")
    elif data[:2] == b"BM" and len(data) >= 34:
        codec = _BMP_CODECS.get(int.from_bytes(data[30:34], "little"))
        if codec is not None:
            raise UnsupportedImage(f"BMP with {codec} compression is not supported")


def _check_codec(img: Image.Image) -> None:
    """Refuse, by name, a codec PIL knows but this build cannot decode; before any pixel is decoded."""
    if img.format == "TIFF":
        assert isinstance(img, TiffImagePlugin.TiffImageFile)
        scheme = int(img.tag_v2.get(259, 1))  # Compression
        if libtiff.codec_configured(scheme) is False:
            name = TiffImagePlugin.COMPRESSION_INFO.get(scheme, "unknown")
            raise UnsupportedImage(
                f"TIFF compression {name!r} (scheme {scheme}) is not available in this build's libtiff"
            )
    elif img.format == "PNG" and "transparency" in img.info and _png_rawmode(img).startswith("RGB;16"):
        raise UnsupportedImage("16-bit colour PNG with a tRNS colour key is not supported")


def _png_rawmode(img: Image.Image) -> str:
    """The PNG sample layout before decoding (e.g. "L;4", "RGB;16B"); only known until load()."""
    tile = getattr(img, "tile", None)  # ImageFile only; a plain Image has no tile list
    return str(tile[0].args) if tile and isinstance(tile[0].args, str) else ""


def _scale_low_bit_transparency(img: Image.Image) -> None:
    """A 2/4-bit grey PNG's tRNS value is a raw sample; PIL scales the samples but not the value."""
    scale = _PNG_LOW_BIT_SCALE.get(_png_rawmode(img)) if img.format == "PNG" else None
    if scale is not None and isinstance(img.info.get("transparency"), int):
        img.info["transparency"] *= scale


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
        _scale_low_bit_transparency(img)
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
    transparent = img.info.get("transparency")
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        return _grey_to_rgb(_scale_16bit(np.asarray(img), transparent))
    if mode == "F":
        values = np.asarray(img, dtype=np.float64)
        grey = _scale_float(values)
        if isinstance(transparent, (int, float)):
            grey[values == transparent] = 255  # alpha 0 composited on white
        return _grey_to_rgb(grey)
    if mode in _ALPHA_MODES or transparent is not None:
        return _composite_on_white(img.convert("RGBA"))
    return img.convert("RGB")


def _composite_on_white(rgba: Image.Image) -> Image.Image:
    # PIL's masked paste computes round((c*a + 255*(255-a)) / 255) exactly (checked over all 256x256 (c, a)
    # pairs in tests/unit/test_images.py) in C, without numpy temporaries for a 50 MP image
    out = Image.new("RGB", rgba.size, (255, 255, 255))
    out.paste(rgba.convert("RGB"), mask=rgba.getchannel("A"))
    return out


_ROWS_PER_CHUNK = 512  # bounds the integer temporaries to a few MB per chunk even for 50 MP images


def _scale_16bit(values: np.ndarray, transparent: object = None) -> np.ndarray:
    """round(v / 257) per sample; white (alpha 0 on white) where the raw sample equals the tRNS value."""
    out = np.empty(values.shape, dtype=np.uint8)  # (H, W)
    key = transparent if isinstance(transparent, int) else None
    for start in range(0, values.shape[0], _ROWS_PER_CHUNK):
        raw = values[start : start + _ROWS_PER_CHUNK].astype(np.int64)
        scaled = (np.clip(raw, 0, 65535) + 128) // 257  # round(v / 257); no tie since 257 is odd
        if key is not None:
            scaled[raw == key] = 255
        out[start : start + _ROWS_PER_CHUNK] = scaled
    return out


def _scale_float(values: np.ndarray) -> np.ndarray:
    finite = values[np.isfinite(values)]
    scale = 255.0 if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0 else 1.0
    v = np.nan_to_num(values * scale, nan=0.0, posinf=255.0, neginf=0.0)
    return np.clip(np.rint(v), 0, 255).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1), "RGB")  # (H, W) -> (H, W, 3)
