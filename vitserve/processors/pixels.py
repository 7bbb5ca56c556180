"""Exact fast pixels for the patch-layout (Qwen) families: HF's resize, rescale, normalize and patchify,
bit for bit, in one pass over uint8 pixels (docs/processing.md "Fast and exact").

Two backends (--image_resize), each equal to one of transformers' image processors:
- ``torch`` (the default): the torchvision ("fast") processor, ``Qwen2VLImageProcessor``, which vLLM and SGLang
  use. It resizes uint8 pixels with torchvision's bicubic antialias resize, which on the CPU is torch's own
  ``F.interpolate(uint8, mode="bicubic", antialias=True)`` (bitwise equal, measured; its float path differs by up
  to 20 levels), so vitserve needs no torchvision: ``resize_uint8``. Then one fused step: mean and std are
  scaled by 1/rescale_factor (a float32 multiply) and each pixel becomes ``(float32(v) - mean) / std`` (a
  float32 subtract and divide): ``torch_value_table``.
- ``pil``: the PIL processor, ``Qwen2VLImageProcessorPil``, as below.

HF's Qwen2VLImageProcessorPil turns the image into numpy, back into PIL for the resize, back into numpy,
then rescales in float64, casts to float32, normalizes on a transposed view and patchifies with a copy that
repeats every patch ``temporal_patch_size`` times: several full-image float copies. Here:

- resize: the same PIL call HF makes (``Image.resize(size, resample=hf.resample)``, no reducing_gap) on the
  same RGB uint8 pixels, so the uint8 result is identical by construction;
- rescale + normalize: a pixel only has 256 values per channel, so HF's own ``rescale`` and ``normalize``
  are run once, at start-up, on a tiny image holding every value: a (C, 256) float32 lookup table. Every
  step of HF's arithmetic is an elementwise IEEE operation (a float64 multiply, a cast, a float32 subtract
  and divide), correctly rounded on every CPU, so a pixel's looked-up value is the value HF computes for it;
- patchify: the uint8 pixels are put in patch order, then looked up chunk by chunk (the temporaries stay
  in cache) and copied into the final (num_patches, C*T*P*P) layout once per temporal patch. A table of float32 pairs (two pixels per lookup)
  was tried: as fast on photos, twice as slow on noise, whose random pairs miss the cache.

PIL's decode and resize and numpy's take and copies release the GIL, so this runs in the API's thread pool
without stalling the event loop. Settings this does not cover (no resize, a resample filter PIL does not
take as an int) keep HF's own path: ``FastPatches.from_hf`` returns None for them.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

Backend = Literal["torch", "pil"]

_CHUNK_PIXELS = 1 << 16  # pixels per channel looked up per step: the temporaries stay in cache


def _value_table(hf: Any) -> npt.NDArray[np.float32]:
    """(C, 256) float32: what HF's rescale and normalize make of each uint8 value, per channel.

    Runs HF's own methods (the ones its _preprocess calls, with the object's settings) on a (3, 1, 256)
    channels-first image holding every value once.
    """
    image: np.ndarray = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()
    if hf.do_rescale:
        image = hf.rescale(image, hf.rescale_factor)
    if hf.do_normalize:
        image = hf.normalize(image, hf.image_mean, hf.image_std)
    return np.asarray(image, dtype=np.float32).reshape(3, 256)  # patchify's own cast


def torch_value_table(hf: Any) -> npt.NDArray[np.float32]:
    """(C, 256) float32: what transformers' torchvision backend (rescale_and_normalize) makes of each uint8
    value, per channel, with the same tensor operations in the same order: mean and std times
    1/rescale_factor when both steps are on (its fused form), then the image in float32, minus mean, divided
    by std. Each is an elementwise IEEE operation, correctly rounded on every CPU, so the table holds exactly
    the values that backend computes, pixel by pixel."""
    values = torch.arange(256, dtype=torch.uint8).reshape(1, 256).expand(3, 256)
    if hf.do_rescale and hf.do_normalize:
        mean = torch.tensor(hf.image_mean) * (1.0 / hf.rescale_factor)
        std = torch.tensor(hf.image_std) * (1.0 / hf.rescale_factor)
        out = values.to(torch.float32).sub(mean.view(-1, 1)).div(std.view(-1, 1))
    elif hf.do_normalize:
        mean, std = torch.tensor(hf.image_mean), torch.tensor(hf.image_std)
        out = values.to(torch.float32).sub(mean.view(-1, 1)).div(std.view(-1, 1))
    elif hf.do_rescale:
        out = values * hf.rescale_factor
    else:
        out = values.to(torch.float32)
    return np.ascontiguousarray(out.to(torch.float32).numpy())


def resize_uint8(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(H, W, C) uint8 -> (height, width, C) uint8 for size = (width, height): bicubic with antialias, as
    torchvision resizes uint8 images on the CPU (bitwise equal to it; vitserve imports no torchvision).
    The video path resizes frames with this same call."""
    width, height = size
    if pixels.shape[0] == height and pixels.shape[1] == width:
        return pixels
    with warnings.catch_warnings():  # a PIL image's array is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        chw = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)  # (1, C, H, W) uint8, a view
    out = torch.nn.functional.interpolate(chw, size=(height, width), mode="bicubic", antialias=True)
    return out[0].permute(1, 2, 0).contiguous().numpy()


class FastPatches:
    """Resize + rescale + normalize + patchify of one RGB image, equal to transformers' Qwen2VLImageProcessor
    (backend "torch") or Qwen2VLImageProcessorPil (backend "pil")."""

    def __init__(self, hf: Any, backend: Backend = "pil") -> None:
        self.backend = backend
        self.resample = int(hf.resample)
        self.patch = int(hf.patch_size)
        self.merge = int(hf.merge_size)
        self.temporal = int(hf.temporal_patch_size)
        self.values = torch_value_table(hf) if backend == "torch" else _value_table(hf)  # (C, 256)

    @classmethod
    def from_hf(cls, hf: Any, backend: Backend = "pil") -> FastPatches | None:
        """The fast path for this HF object, or None where only HF's own code covers its settings."""
        if not getattr(hf, "do_resize", False) or not isinstance(hf.resample, int):
            return None
        if backend == "torch" and int(hf.resample) != int(Image.Resampling.BICUBIC):
            return None  # torch resizes bicubic only; the family processors all use it
        return cls(hf, backend)

    def __call__(self, image: Image.Image, size: tuple[int, int]) -> np.ndarray:
        """(num_patches, C*T*P*P) float32 for an RGB image resized to ``size`` = (width, height)."""
        if self.backend == "torch":
            return self.patchify(resize_uint8(np.asarray(image), size))
        resized = image.resize(size, resample=self.resample)  # the PIL call HF's PilBackend.resize makes
        pixels = np.asarray(resized)  # (H, W, C) uint8
        resized.close()
        return self.patchify(pixels)

    def patchify(self, pixels: np.ndarray) -> np.ndarray:
        """(H, W, C) uint8 -> (num_patches, C*T*P*P) float32 in HF's patch order, normalized."""
        p, m, t = self.patch, self.merge, self.temporal
        height, width, channels = pixels.shape
        rows, cols = height // (p * m), width // (p * m)  # merge groups
        per_row = cols * m * m  # patches in one row of merge groups
        out = np.empty((rows * per_row, channels, t, p * p), dtype=np.float32)
        # (rows, m, p, cols, m, p, C) -> (C, rows, cols, m, m, p, p): HF's patch order, one plane per channel
        grouped = pixels.reshape(rows, m, p, cols, m, p, channels).transpose(6, 0, 3, 1, 4, 2, 5)
        step = max(1, _CHUNK_PIXELS // (per_row * p * p))  # rows of merge groups per chunk
        # intp: take would convert uint8 indices to intp in a pass of its own; the reordering copy, which
        # costs the same either way, converts them on the way (8-10% of this function, measured)
        planes = np.empty((channels, step, cols, m, m, p, p), dtype=np.intp)
        looked_up = np.empty((step * per_row, p * p), dtype=np.float32)
        for r0 in range(0, rows, step):
            k = min(rows, r0 + step) - r0
            n = k * per_row  # patches in this chunk
            planes[:, :k] = grouped[:, r0 : r0 + k]
            dest = out[r0 * per_row : r0 * per_row + n]  # (n, C, T, P*P)
            for c in range(channels):
                # a 256-entry table stays in L1; mode="clip" lets take write its output unbuffered
                np.take(self.values[c], planes[c, :k].reshape(n, p * p), out=looked_up[:n], mode="clip")
                for j in range(t):
                    dest[:, c, j] = looked_up[:n]
        return out.reshape(rows * per_row, channels * t * p * p)
