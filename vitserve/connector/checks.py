"""Why the connector refuses a message: the stable reason codes (the `refused_<code>` counters, and the first word
of every nack's reason), the checks of one embedding message against the model, and a log that says each kind of
trouble at most once per interval, so a flood of one refusal cannot flood vLLM's log."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from vitserve.rpc.wire import ImageEmbedding

# Every way one message can be refused. A nack's reason is "<code>: <what, with the numbers>".
REASONS = (
    "no_uuid",  # the message names no uuid (the connector keeps tensors by their encoder-cache key)
    "expired",  # its expires_at has passed
    "shape",  # zero rows, rows that disagree with the grid or between levels, or not the model's width
    "too_large",  # more bytes than the whole bound (max_gb, or the device's free space if smaller)
    "full",  # does not fit beside the tensors still claimed, pinned or promised
    "device_full",  # the shm device said ENOSPC, also after evicting what is spent
    "conflict",  # the uuid is held with another shape and a scheduled request will load it
    "write_failed",  # the file could not be written (any other OSError)
    "bad_file",  # a same-host file message whose file is not what it says (connector/handoff.py)
    "internal",  # anything else that went wrong while taking it (a bug: the log has the traceback)
)


@dataclass(frozen=True)
class Shape:
    """What a message must agree with: the model's width (0: unchecked) and spatial merge."""

    width: int
    merge: int


class Refusal(Exception):  # noqa: N818  # a refusal, not an error of the connector
    """One message refused: `code` is one of REASONS, `text` says why with the numbers."""

    def __init__(self, code: str, text: str) -> None:
        assert code in REASONS, code
        super().__init__(f"{code}: {text}")
        self.code, self.text = code, text


def check_message(m: ImageEmbedding, shape: Shape, now: float) -> tuple[int, int, int]:
    """(rows, width, nbytes) of the tensor the message makes (main rows and DeepStack levels side by side),
    computed from the shapes alone, before any byte is copied; Refusal for what cannot be kept."""
    if m.uuid is None:
        raise Refusal(
            "no_uuid", "the message names no uuid (the connector keeps tensors by encoder-cache key)"
        )
    if m.expires_at <= now:
        raise Refusal("expired", f"expired {now - m.expires_at:.3f} s ago")
    parts = (m.embedding, *m.deepstack)
    rows = int(m.embedding.shape[0])
    if rows == 0:
        raise Refusal("shape", f"zero rows (grid {list(m.grid_thw)}): an item has at least one row")
    if any(int(d.shape[0]) != rows for d in m.deepstack):
        levels = [int(d.shape[0]) for d in m.deepstack]
        raise Refusal("shape", f"deepstack rows {levels} differ from the embedding's {rows}")
    t, h, w = m.grid_thw
    merge = shape.merge
    if rows != t * h * w // (merge * merge) or (h % merge) or (w % merge):
        raise Refusal(
            "shape",
            f"{rows} rows, but grid {list(m.grid_thw)} with merge {merge} needs {t * h * w // merge**2}",
        )
    width = sum(int(x.shape[1]) for x in parts)
    if width == 0:
        raise Refusal("shape", f"zero columns ({rows} rows of width 0)")
    if shape.width and width != shape.width:
        raise Refusal(
            "shape",
            f"width {width}, but this model needs {shape.width} (hidden size x (1 + DeepStack levels))",
        )
    return rows, width, rows * width * m.embedding.element_size()


class RateLimitedLog:
    """At most one line per key per `every_s`; the next line says how many were not logged in between."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = log, every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def __call__(self, key: str, level: int, text: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._quiet[key] = self._quiet.get(key, 0) + 1
            return
        self._last[key] = now
        quiet = self._quiet.pop(key, 0)
        if quiet:
            text += f" ({quiet} more like it in the last {self.every_s:g} s were not logged)"
        self.log.log(level, text, *args, exc_info=exc_info)
