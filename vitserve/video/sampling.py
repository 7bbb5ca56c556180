"""Which frames of a video are encoded: the frame indices of each family's transformers video processor
(docs/processing.md "Video"), computed with the same expressions, and a 400 for every setting it crashes on
or leaves ambiguous.

The three samplers, as transformers 5.23 writes them (``sample_frames`` of each video processor):
- ``qwen2`` (Qwen2-VL, Qwen2.5-VL): ``num_frames`` is rounded to a multiple of ``temporal_patch_size``; with
  ``fps`` the count is ``total / source_fps * fps`` bounded by ``min_frames``, ``max_frames`` and the video,
  floored to a multiple of ``temporal_patch_size``; indices ``torch.arange(0, total, total / n).int()``.
- ``qwen3`` (Qwen3-VL, Qwen3.5): with ``fps`` the count is ``int(total / source_fps * fps)`` bounded the same
  way (not rounded); indices ``np.linspace(0, total - 1, n).round()``.
- ``internvl``: with ``fps`` the count is ``int(total / source_fps * fps)``; indices
  ``torch.arange(shift, total, total / n).int()`` with ``shift = total / n / 2`` (``initial_shift``).

``torch.arange`` with a float step sometimes yields one index more than asked, and that index is the frame
count itself (17 frames, 14 asked: ``[0, 1, ..., 15, 17]``): transformers then fails on the missing frame
(IndexError), so such a request is a 400 here, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from vitserve.errors import InvalidVideoSampling

Sampler = Literal["qwen2", "qwen3", "internvl"]


@dataclass(frozen=True)
class SamplingRules:
    """A family's sampling settings, resolved from its video processor config (vitserve/video/settings.py)."""

    sampler: Sampler
    temporal_patch_size: int  # frames per temporal group (1 for InternVL: every frame is its own tile)
    min_frames: int  # qwen samplers: fps sampling takes at least this many frames (the video allowing)
    max_frames: int  # qwen samplers: ... and at most this many
    default_fps: float  # when a request sets neither fps nor num_frames
    initial_shift: bool | float = True  # internvl: True = half a step, so frames come from mid-interval


@dataclass(frozen=True)
class Sampling:
    """The frames of one video that are encoded, and the time axis they sit on."""

    frame_indices: tuple[int, ...]  # into the decoded video, ascending, without repeats
    total_frames: int  # frames in the video
    source_fps: float  # the container's frame rate
    fps: float | None  # the fps sampled at (requested or default); None when num_frames was asked
    num_frames: int | None  # the num_frames asked; None when sampled by fps

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled video, as transformers' VideoMetadata.sampled_fps computes it."""
        return len(self.frame_indices) / self.total_frames * self.source_fps

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.source_fps


def sample(
    rules: SamplingRules,
    total_frames: int,
    source_fps: float | None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
) -> Sampling:
    """The frames transformers' video processor samples from a video of ``total_frames`` at ``source_fps``.

    ``fps`` and ``num_frames`` are the request's (at most one of them); neither means ``rules.default_fps``.
    Raises InvalidVideoSampling naming the setting where transformers would crash or guess.
    """
    _check_video(total_frames, source_fps)
    assert source_fps is not None  # _check_video refused None
    if fps is not None and num_frames is not None:
        raise InvalidVideoSampling(
            f"fps ({fps}) and num_frames ({num_frames}) were both given; they are two ways to choose the "
            "frames: give one of them"
        )
    if num_frames is None:
        fps = rules.default_fps if fps is None else fps
        if not math.isfinite(fps) or fps <= 0:
            raise InvalidVideoSampling(f"fps must be a positive number, got {fps}")
    elif isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise InvalidVideoSampling(f"num_frames must be a whole number >= 1, got {num_frames!r}")
    elif num_frames > total_frames:
        # Qwen2-VL and InternVL raise here; Qwen3-VL would repeat frames. Never a video with made-up frames.
        raise InvalidVideoSampling(
            f"num_frames={num_frames} is more than the video's {total_frames} frames; ask for at most "
            f"{total_frames}"
        )
    indices = _INDICES[rules.sampler](rules, total_frames, source_fps, fps, num_frames)
    if indices[-1] >= total_frames:
        what = f"num_frames={num_frames}" if num_frames is not None else f"fps={fps}"
        raise InvalidVideoSampling(
            f"{what} on a video of {total_frames} frames makes transformers' sampler step past the last frame "
            f"(index {indices[-1]}); ask for another num_frames or fps"
        )
    return Sampling(tuple(int(i) for i in indices), total_frames, float(source_fps), fps, num_frames)


def _check_video(total_frames: int, source_fps: float | None) -> None:
    if total_frames < 1:
        raise InvalidVideoSampling("the video has no frames")
    if source_fps is None or not math.isfinite(source_fps) or source_fps <= 0:
        # transformers raises (Qwen2-VL, InternVL) or silently assumes 24 fps (Qwen3-VL, and Qwen2.5-VL's
        # second_per_grid_ts): the frames' times would be guesses.
        raise InvalidVideoSampling(
            f"the video's frame rate is unknown (source fps {source_fps}); re-encode it with a frame rate"
        )


def _too_short(total_frames: int, count: int, group: int, what: str) -> InvalidVideoSampling:
    return InvalidVideoSampling(
        f"{what} samples {count} frame(s) from a video of {total_frames}; the model encodes frames in groups of "
        f"{group}: give a longer video, a higher fps or num_frames >= {group}"
    )


def _qwen2(
    rules: SamplingRules, total: int, source_fps: float, fps: float | None, asked: int | None
) -> list[int]:
    tps = rules.temporal_patch_size
    if asked is not None:
        n = round(asked / tps) * tps
        what = f"num_frames={asked} (rounded to a multiple of {tps})"
        if n > total:
            raise InvalidVideoSampling(
                f"{what} asks for {n} frames from a video of {total}; ask for at most {total // tps * tps}"
            )
    else:
        assert fps is not None
        max_frames = math.floor(min(rules.max_frames, total) / tps) * tps
        count = min(max(total / source_fps * fps, rules.min_frames), max_frames, total)
        n = math.floor(count / tps) * tps
        what = f"fps={fps}"
    if n < tps:
        raise _too_short(total, n, tps, what)
    indices: list[int] = torch.arange(0, total, total / n).int().tolist()
    return indices


def _qwen3(
    rules: SamplingRules, total: int, source_fps: float, fps: float | None, asked: int | None
) -> list[int]:
    if asked is not None:
        n, what = asked, f"num_frames={asked}"
    else:
        assert fps is not None
        n = min(max(int(total / source_fps * fps), rules.min_frames), rules.max_frames, total)
        what = f"fps={fps}"
    if n < rules.temporal_patch_size:  # transformers' smart_resize raises on fewer frames than one group
        raise _too_short(total, n, rules.temporal_patch_size, what)
    indices: list[int] = np.linspace(0, total - 1, n).round().astype(int).tolist()
    return indices


def _internvl(
    rules: SamplingRules, total: int, source_fps: float, fps: float | None, asked: int | None
) -> list[int]:
    if asked is not None:
        n = asked
    else:
        assert fps is not None
        n = int(total / source_fps * fps)
        if n < 1:  # transformers divides by zero
            raise _too_short(total, n, 1, f"fps={fps}")
    shift: float = total / n / 2 if rules.initial_shift is True else float(rules.initial_shift)
    indices: list[int] = torch.arange(shift, total, total / n).int().tolist()
    return indices


_INDICES = {"qwen2": _qwen2, "qwen3": _qwen3, "internvl": _internvl}
