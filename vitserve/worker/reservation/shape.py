"""What bounds a batch at start-up: the flags, and what the image processor allows per image.

Built once, in the CLI process, from the processor it loads anyway (vitserve/cli.py), and carried to every
rank in its WorkerArgs: no rank loads an image processor, so the engine side never imports
vitserve.processors (the import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vitserve.config import Config
from vitserve.families import FAMILIES


@dataclass(frozen=True)
class StressShape:
    """The worst case's bounds (worst_case.py): the budget and image cap, and the processor's per-image limits."""

    budget_tokens: int  # --visual_batch_max_tokens (0: no vitserve clamp)
    max_batch_images: int  # --visual_infer_batch_size
    max_tiles_per_image: int | None = None  # InternVL: the processor's max_patches + the thumbnail
    max_image_tokens: int | None = None  # the processor's largest image in tokens; bounds budget 0
    min_image_tokens: int | None = None  # the family's smallest image (one tile): --visual_mem_gb's floor

    @classmethod
    def of(cls, config: Config, clamp: Mapping[str, Any] | None = None) -> StressShape:
        """The flags' bounds, plus the limits in a processor's clamp_info() when one is given. Without it
        (an Engine built outside the CLI), budget 0 stresses a default size with a warning, and InternVL's
        tiles are grouped by the budget alone, which never needs less memory (worst_case.py)."""
        shape = cls(config.budget_tokens, config.max_batch_images)
        if clamp is None:
            return shape
        if FAMILIES[clamp["family"]].layout == "tiles":
            patches = int(clamp["max_patches"])
            tiles = patches + (1 if patches > 1 else 0)  # the thumbnail, when an image is split
            per_tile = int(clamp["tokens_per_tile"])
            return dataclasses.replace(
                shape,
                max_tiles_per_image=tiles,
                max_image_tokens=tiles * per_tile,
                min_image_tokens=per_tile,
            )
        factor = int(clamp["patch_size"]) * int(clamp["merge_size"])
        smallest = int(clamp.get("min_tokens") or 0) or None
        return dataclasses.replace(
            shape, max_image_tokens=int(clamp["max_pixels"]) // factor**2, min_image_tokens=smallest
        )

    def bounds(self) -> dict[str, int | None]:
        """The processor's limits, as worst_case.py's keyword arguments."""
        return {"max_tiles_per_image": self.max_tiles_per_image, "max_image_tokens": self.max_image_tokens}
