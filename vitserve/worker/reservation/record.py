"""The one record of a rank's reservation: the bytes it publishes and how they were found."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal


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
        }

    @classmethod
    def from_stored(cls, body: dict[str, Any]) -> Reservation:
        """The inverse of stored(); raises KeyError, ValueError or TypeError on a malformed body."""
        fields = {k: body[k] for k in ("bytes", "tokens", "images", "detail")}
        if not all(isinstance(fields[k], int) for k in ("bytes", "tokens", "images")):
            raise TypeError(f"not a stored reservation: {body!r}")
        budget = body.get("budget_tokens", 0)
        if not isinstance(budget, int):
            raise TypeError(f"not a stored reservation: {body!r}")
        return cls(method=Method(body["method"]), budget_tokens=budget, **fields)
