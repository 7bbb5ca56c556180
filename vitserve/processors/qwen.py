"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (HF's Qwen2VLImageProcessor, torchvision or PIL backend)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.image_utils import SizeDict

from vitserve.contract import ProcessedImage
from vitserve.errors import ConfigError
from vitserve.processors.base import VisionProcessor, as_rgb, call_hf, check_grid
from vitserve.processors.budget import Plan, QwenGeometry, plan_qwen
from vitserve.processors.pixels import Backend, FastPatches


class QwenProcessor(VisionProcessor):
    """pixel_values: HF's flat patches (num_patches, C*T*P*P); grid_thw = (1, h_patches, w_patches).

    ``resize`` (--image_resize): "torch" equals transformers' torchvision processor, "pil" its PIL one
    (vitserve/processors/pixels.py). ``hf`` is the PIL processor object either way: it holds the settings.
    """

    def __init__(
        self, family: str, hf: Qwen2VLImageProcessorPil, budget_tokens: int, resize: Backend = "torch"
    ):
        self.family = family
        self.hf = hf
        self.budget_tokens = budget_tokens
        self.resize = resize
        self.geometry = QwenGeometry(
            patch_size=int(hf.patch_size),
            merge_size=int(hf.merge_size),
            min_pixels=int(hf.size["shortest_edge"]),
            max_pixels=int(hf.size["longest_edge"]),
        )
        self._clamp_hf()
        self.fast = FastPatches.from_hf(hf, resize)  # None: HF's own code for settings it does not cover
        if self.fast is None and resize == "torch":
            raise ConfigError(
                f"--image_resize torch reproduces the bicubic resize of {family}'s processor; this checkpoint's "
                f"preprocessor_config.json asks for resample={hf.resample!r}, do_resize={hf.do_resize}: "
                "use --image_resize pil"
            )

    def _clamp_hf(self) -> None:
        """Write the clamp into the HF object so it also holds when HF is called directly.

        transformers 5.x reads only ``size["longest_edge"]`` (``min_pixels``/``max_pixels`` init kwargs are
        folded into ``size``); older versions read a ``max_pixels`` attribute, set too where it exists.
        """
        if self.budget_tokens <= 0:
            return  # exactly as HF ships it
        clamp = self.geometry.clamped_max_pixels(self.budget_tokens)
        size = self.hf.size
        if isinstance(size, SizeDict):
            new = {"longest_edge": clamp}
            if size.max_pixels is not None:
                new["max_pixels"] = clamp
            self.hf.size = dataclasses.replace(size, **new)
        else:
            self.hf.size = {**size, "longest_edge": clamp}
        if getattr(self.hf, "max_pixels", None) is not None:
            self.hf.max_pixels = clamp

    def plan(self, width: int, height: int) -> Plan:
        return plan_qwen(width, height, self.geometry, self.budget_tokens)

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        plan = self.plan(*image.size)
        image = as_rgb(image)
        if self.fast is not None:
            # equal to HF's output bit for bit, with a fraction of its work (vitserve/processors/pixels.py)
            pixel_values = torch.from_numpy(self.fast(image, plan.resized_size))
        else:
            pixel_values = self._preprocess_hf(image, plan)
        return ProcessedImage(
            pixel_values=pixel_values,  # (num_patches, C*T*P*P)
            grid_thw=plan.grid_thw,
            num_tokens=plan.num_tokens,
            resized_size=plan.resized_size,
            clamped=plan.clamped,
        )

    def _preprocess_hf(self, image: Image.Image, plan: Plan) -> torch.Tensor:
        """HF's own processor on the planned size."""
        if plan.hf_native:
            out = call_hf(self.hf, image, self.family)
        else:
            # HF's smart_resize would overshoot the budget here: resize to the planned size with the same
            # PIL filter HF uses (its PIL backend resizes uint8 pixels with Image.resize), then let HF do
            # the rest (rescale, normalize, patchify) without resizing again.
            resized = image.resize(plan.resized_size, resample=self.hf.resample)
            out = call_hf(self.hf, resized, self.family, do_resize=False)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        check_grid(plan, grid, self.family)  # type: ignore[arg-type]
        pixel_values: torch.Tensor = out["pixel_values"]
        return pixel_values

    def clamp_info(self) -> dict[str, Any]:
        clamp = self.geometry.clamped_max_pixels(self.budget_tokens)
        return {
            "family": self.family,
            "max_tokens": self.budget_tokens,
            "max_pixels": clamp,
            "longest_edge": clamp,  # HF's size["longest_edge"] is a pixel count for this processor
            "min_pixels": self.geometry.min_pixels,
            "min_tokens": self.geometry.min_tokens,
            "patch_size": self.geometry.patch_size,
            "merge_size": self.geometry.merge_size,
            "image_resize": self.resize,  # which transformers processor the pixels equal (keys the cache)
        }
