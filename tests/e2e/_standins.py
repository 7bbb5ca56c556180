"""Temporary stand-ins for vitserve.images / vitserve.processors while those land on main (proc helper).

Installed into sys.modules by tests/e2e/conftest.py ONLY when the real module cannot be imported; they
follow INTERFACES.md (header pixel check before decode, budget-clamped Qwen2-VL PIL processor).
"""

from __future__ import annotations

import io
import math
import types
from dataclasses import dataclass

import torch
from PIL import Image, ImageOps

from vitserve.errors import AspectRatioTooLarge, ImageTooSmall, InvalidImage, OverTokenBudget, PayloadTooLarge
from vitserve.types import ProcessedImage

Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image
    original_size: tuple[int, int]
    format: str


def decode_image(data: bytes, *, max_image_pixels: int) -> DecodedImage:
    if not data:
        raise InvalidImage("empty image data")
    try:
        img = Image.open(io.BytesIO(data), formats=("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"))
    except Exception as exc:
        raise InvalidImage("not an image in an allowed format") from exc
    if img.width * img.height > max_image_pixels:
        raise PayloadTooLarge(f"{img.width}x{img.height} is over {max_image_pixels} pixels (--max_image_pixels)")
    try:
        img.seek(0)
        img.load()
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:
        raise InvalidImage("truncated or corrupt image data") from exc
    return DecodedImage(rgb, rgb.size, str(img.format))


class StandInProcessor:
    family = "qwen2_5_vl"

    def __init__(self, max_tokens: int = 0):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.max_tokens = max_tokens
        self.max_pixels = 12845056 if not max_tokens else min(12845056, max_tokens * 28 * 28)
        self.hf = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=self.max_pixels, patch_size=14,
                                           temporal_patch_size=2, merge_size=2)

    def _size(self, width: int, height: int) -> tuple[int, int]:
        if min(width, height) < 1:
            raise ImageTooSmall("image has a zero side")
        if max(width, height) / min(width, height) > 200:
            raise AspectRatioTooLarge(f"aspect ratio {max(width, height) / min(width, height):.0f} is over 200")
        h, w = round(height / 28) * 28, round(width / 28) * 28
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(28, math.floor(height / beta / 28) * 28), max(28, math.floor(width / beta / 28) * 28)
        elif h * w < 3136:
            beta = math.sqrt(3136 / (height * width))
            h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
        return w, h

    def count_tokens(self, width: int, height: int) -> int:
        w, h = self._size(width, height)
        tokens = (w // 28) * (h // 28)
        if self.max_tokens and tokens > self.max_tokens:
            raise OverTokenBudget(f"{tokens} tokens over {self.max_tokens} (--visual_batch_max_tokens)")
        return tokens

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        tokens = self.count_tokens(*image.size)
        w, h = self._size(*image.size)
        out = self.hf(images=[image.resize((w, h), Image.BICUBIC)], return_tensors="pt", do_resize=False)
        unclamped = round(image.height / 28) * round(image.width / 28)
        return ProcessedImage(out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0]), tokens,
                              (w, h), bool(self.max_tokens) and unclamped > self.max_tokens)

    def clamp_info(self) -> dict:
        return {"max_pixels": self.max_pixels, "longest_edge": self.max_pixels}


def load_image_processor(name_or_path: str, max_tokens: int = 0) -> StandInProcessor:
    return StandInProcessor(max_tokens)


def as_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


torch.set_num_threads(1)
