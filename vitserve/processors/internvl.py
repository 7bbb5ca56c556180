"""InternVL (HF's GotOcr2ImageProcessor with dynamic tiling; torchvision or PIL backend, --image_resize).

pixel_values: (num_tiles, 3, tile, tile) — the tiles HF cuts (plus the thumbnail when there is more than one
tile), exactly as InternVLProcessor produces them (it calls the image processor with crop_to_patches=True).
grid_thw: (num_tiles, tile // patch, tile // patch); num_tokens = num_tiles * tokens_per_tile
(tokens_per_tile from vitserve.families.tokens_per_tile: 256 for 448/14/0.5).
resized_size: the tiled canvas (columns * tile, rows * tile) the image is resized to before cutting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import GotOcr2ImageProcessorPil

from vitserve.contract import ProcessedImage
from vitserve.processors.base import VisionProcessor, as_rgb, call_hf, check_grid
from vitserve.processors.budget import Plan, TileGeometry, plan_tiles
from vitserve.processors.pixels import Backend, resize_uint8, torch_value_table


class InternVLProcessor(VisionProcessor):
    def __init__(
        self,
        family: str,
        hf: GotOcr2ImageProcessorPil,
        budget_tokens: int,
        *,
        patch_size: int,
        tokens_per_tile: int,
        resize: Backend = "torch",
    ):
        self.family = family
        self.hf = hf
        self.budget_tokens = budget_tokens
        self.resize = resize
        # torch: transformers' torchvision GotOcr2ImageProcessor, with torch alone (pixels.py); pil: HF's own
        self.values = torch_value_table(hf) if resize == "torch" else None
        self.geometry = TileGeometry(
            tile_height=int(hf.size["height"]),
            tile_width=int(hf.size["width"]),
            patch_size=patch_size,
            tokens_per_tile=tokens_per_tile,
            min_patches=int(hf.min_patches),
            max_patches=int(hf.max_patches),
        )
        if budget_tokens > 0:
            # the clamp lives in the HF object, so calling it directly respects the budget too
            self.hf.max_patches = self.geometry.clamped_max_patches(budget_tokens)
            self.hf.min_patches = min(self.geometry.min_patches, self.hf.max_patches)

    def plan(self, width: int, height: int) -> Plan:
        return plan_tiles(width, height, self.geometry, self.budget_tokens)

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        plan = self.plan(*image.size)
        if self.values is not None:
            pixel_values = self._tiles_torch(np.asarray(as_rgb(image)), plan)
        else:
            out = call_hf(self.hf, as_rgb(image), self.family, crop_to_patches=True)
            pixel_values = out["pixel_values"]  # (num_tiles, 3, tile_h, tile_w)
        grid = (int(pixel_values.shape[0]), plan.grid_thw[1], plan.grid_thw[2])
        check_grid(plan, grid, self.family)
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=plan.grid_thw,
            num_tokens=plan.num_tokens,
            resized_size=plan.resized_size,
            clamped=plan.clamped,
        )

    def _tiles_torch(self, pixels: np.ndarray, plan: Plan) -> torch.Tensor:
        """What the torchvision GotOcr2ImageProcessor cuts (crop_to_patches): the image resized to the tiled
        canvas, its tiles in row-major order, then, when there is more than one, the whole image resized to
        one tile (the thumbnail); each pixel normalized through the (C, 256) table."""
        assert self.values is not None
        th, tw = self.geometry.tile_height, self.geometry.tile_width
        cols, rows = plan.resized_size[0] // tw, plan.resized_size[1] // th
        canvas = resize_uint8(pixels, plan.resized_size)  # (rows*th, cols*tw, C) uint8
        tiles = canvas.reshape(rows, th, cols, tw, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, th, tw, 3)
        if rows * cols > 1:
            tiles = np.concatenate([tiles, resize_uint8(pixels, (tw, th))[None]])
        out = np.empty((tiles.shape[0], 3, th, tw), dtype=np.float32)  # (num_tiles, C, H, W)
        for c in range(3):
            np.take(self.values[c], tiles[..., c], out=out[:, c])
        return torch.from_numpy(out)

    def clamp_info(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "max_tokens": self.budget_tokens,
            "max_patches": int(self.hf.max_patches),
            "min_patches": int(self.hf.min_patches),
            "tile_size": self.geometry.tile_height,
            "tokens_per_tile": self.geometry.tokens_per_tile,
            "image_resize": self.resize,  # which transformers processor the pixels equal (keys the cache)
        }
