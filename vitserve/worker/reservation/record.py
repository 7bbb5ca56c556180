"""The reservation's two records: what bounds a batch at start-up (`StressShape`) and what a rank publishes and
how it was found (`Reservation`).

StressShape is built once, in the CLI process, from the flags and the processor it loads anyway
(vitserve/cli.py), and carried to every rank in its WorkerArgs: no rank loads an image processor, so the
engine side never imports vitserve.processors (the import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from vitserve.config import Config
from vitserve.families import FAMILIES


class Method(str, Enum):  # noqa: UP042 (the cache file and the log use .value)
    """How the reserved bytes were found (docs/engine.md, "The reservation")."""

    FULL = "full"  # the full-budget stress ran and was measured
    EXTRAPOLATED = "extrapolated"  # probes at smaller budgets, fitted by memory_model
    STORED = "stored"  # an earlier start's measurement under the same key (cache.py)
    OVERRIDE = "override"  # --visual_reserved_mem_gb


@dataclass(frozen=True)
class Reservation:
    bytes: int  # what is published: activation memory of the worst case, its factors included
    method: Method
    tokens: int = 0  # image tokens in the worst-case batch (0 for an override)
    images: int = 0  # images in the worst-case batch
    detail: str = ""  # which shapes were measured, for the log
    baseline: int = 0  # what the bytes count from: CPU RSS / CUDA pool before the stress (PeakWatch)
    budget_tokens: int = 0  # --visual_mem_gb: the budget chosen (sizing.py); 0: the flag's budget
    # --visual_mem_gb: why that budget (budget_search.Outcome.why: the target, the model's prediction there, the
    # budgets measured behind it, which limit bound it); None otherwise
    sizing: dict[str, Any] | None = None

    @property
    def source(self) -> Literal["stress", "override"]:
        """The reservation file's and /v1/info's word for it (docs/integration.md)."""
        return "override" if self.method is Method.OVERRIDE else "stress"

    def stored(self) -> dict[str, Any]:
        """The fields an earlier start's measurement keeps in the cache (not the baseline: per process)."""
        return {
            "bytes": self.bytes,
            "method": self.method.value,
            "tokens": self.tokens,
            "images": self.images,
            "detail": self.detail,
            "budget_tokens": self.budget_tokens,
            "sizing": self.sizing,
        }

    @classmethod
    def from_stored(cls, body: dict[str, Any]) -> Reservation:
        """The inverse of stored(); raises KeyError, ValueError or TypeError on a malformed body."""
        fields = {k: body[k] for k in ("bytes", "tokens", "images", "detail")}
        if not all(isinstance(fields[k], int) for k in ("bytes", "tokens", "images")):
            raise TypeError(f"not a stored reservation: {body!r}")
        budget, sizing = body.get("budget_tokens", 0), body.get("sizing")
        if not isinstance(budget, int) or not (sizing is None or isinstance(sizing, dict)):
            raise TypeError(f"not a stored reservation: {body!r}")
        return cls(method=Method(body["method"]), budget_tokens=budget, sizing=sizing, **fields)


@dataclass(frozen=True)
class StressShape:
    """The worst case's bounds (worst_case.py): the budget and image cap, and the processor's per-image limits."""

    visual_batch_max_tokens: int  # merged tokens per batch (0: no vitserve clamp), the Config's name
    visual_infer_batch_size: int  # images per batch, the Config's name
    max_tiles_per_image: int | None = None  # InternVL: the processor's max_patches + the thumbnail
    max_image_tokens: int | None = None  # the processor's largest image in tokens; bounds budget 0
    min_image_tokens: int | None = None  # the family's smallest image (one tile): --visual_mem_gb's floor

    @classmethod
    def of(cls, config: Config, clamp: Mapping[str, Any] | None = None) -> StressShape:
        """The flags' bounds, plus the limits in a processor's clamp_info() when one is given. Without it
        (an Engine built outside the CLI), budget 0 stresses a default size with a warning, and InternVL's
        tiles are grouped by the budget alone, which never needs less memory (worst_case.py)."""
        shape = cls(config.visual_batch_max_tokens, config.visual_infer_batch_size)
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
