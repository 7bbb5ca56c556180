"""The video processor of a family: frames in, pixels equal to transformers' video processor out, and the
video cut into its temporal groups, each one queue item (docs/processing.md "Video").

Usage::

    proc = load_video_processor(checkpoint, budget_tokens=8192, max_video_tokens=16384)
    sampling = proc.sample(total_frames=300, source_fps=29.97, fps=2)  # which frames to decode
    video = proc.preprocess(frames, sampling)  # frames: (len(indices) or total, H, W, 3) uint8
    for group in proc.groups(video): ...  # grid (1, h, w) each, with its index, count and time range

Pixels: each frame is resized with the torch resize of vitserve/processors/pixels.py (uint8 bicubic with
antialias, bitwise equal to the torchvision resize transformers' video processors make), then normalised
through the (C, 256) table of transformers' fused rescale-and-normalize, then laid out as transformers'
``patchify`` lays them: an odd frame count is padded with a copy of the last frame, each patch row holds
(C, temporal_patch_size, P, P) values, rows in (group, merge block row, merge block column, m, m) order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitserve.checkpoint import Checkpoint
from vitserve.errors import ConfigError, InvalidVideoSampling
from vitserve.processors import load_image_processor
from vitserve.processors.pixels import resize_uint8, torch_value_table
from vitserve.video.plan import VideoPlan, plan_video
from vitserve.video.sampling import Sampling, sample
from vitserve.video.settings import VideoSettings, video_settings


@dataclass(frozen=True)
class VideoTimes:
    """Where a video's temporal groups sit in time, known from its sampling alone."""

    group_times: tuple[
        tuple[float, float], ...
    ]  # per group: (start_s, end_s), its first and last frame's time
    second_per_grid_t: float | None  # Qwen2.5-VL: temporal_patch_size / sampled_fps; else None
    timestamps_s: (
        tuple[float, ...] | None
    )  # Qwen3-VL/3.5: per group, the mean of its first and last frame's time


@dataclass(frozen=True)
class ProcessedVideo:
    """One video ready for the encoder, with the metadata transformers' processors give the LLM."""

    pixel_values_videos: torch.Tensor  # Qwen: (T*h*w, C*temporal*P*P); InternVL: (frames, C, tile, tile)
    video_grid_thw: tuple[int, int, int]  # (T, h, w); InternVL: (frames, tile/patch, tile/patch)
    sampling: Sampling  # frame indices, total frames, source fps
    plan: VideoPlan  # resized size, tokens, clamp
    times: VideoTimes  # where its temporal groups sit in time

    @property
    def group_times(self) -> tuple[tuple[float, float], ...]:
        return self.times.group_times

    @property
    def second_per_grid_t(self) -> float | None:
        return self.times.second_per_grid_t

    @property
    def timestamps_s(self) -> tuple[float, ...] | None:
        return self.times.timestamps_s

    @property
    def frame_indices(self) -> tuple[int, ...]:
        return self.sampling.frame_indices

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


@dataclass(frozen=True)
class VideoGroup:
    """One temporal group of a video: one queue item, encoded exactly as it is inside the whole video."""

    index: int  # 0-based, in time order
    count: int  # groups in the video
    pixel_values: torch.Tensor  # this group's rows of pixel_values_videos (InternVL: its one frame)
    grid_thw: tuple[int, int, int]  # (1, h, w)
    num_tokens: int
    start_s: float  # time of the group's first frame in the video
    end_s: float  # time of its last frame (the padding copy's, for a padded last group)


class VideoProcessor:
    """A family's video processor under ``--visual_batch_max_tokens`` (per group) and ``--max_video_tokens``."""

    def __init__(self, settings: VideoSettings, budget_tokens: int, max_video_tokens: int) -> None:
        if budget_tokens < 0 or max_video_tokens < 0:
            raise ConfigError(
                f"--visual_batch_max_tokens ({budget_tokens}) and --max_video_tokens ({max_video_tokens}) "
                "must be >= 0"
            )
        self.settings = settings
        self.family = settings.family
        self.budget_tokens = budget_tokens
        self.max_video_tokens = max_video_tokens
        self.values = torch_value_table(settings)  # (C, 256) float32: transformers' rescale + normalize

    def sample(
        self,
        total_frames: int,
        source_fps: float | None,
        *,
        fps: float | None = None,
        num_frames: int | None = None,
    ) -> Sampling:
        """The frames to decode; raises InvalidVideoSampling (400) for settings transformers cannot take."""
        return sample(self.settings.sampling, total_frames, source_fps, fps=fps, num_frames=num_frames)

    def plan(self, width: int, height: int, num_frames: int) -> VideoPlan:
        """Frame size, grid and tokens for ``num_frames`` sampled frames of width x height."""
        return plan_video(self.settings, width, height, num_frames, self.budget_tokens, self.max_video_tokens)

    def preprocess(
        self,
        frames: np.ndarray | Sequence[np.ndarray],
        sampling: Sampling,
        *,
        source_size: tuple[int, int] | None = None,
    ) -> ProcessedVideo:
        """Pixels for the sampled frames: ``frames`` is (len(frame_indices), H, W, 3) uint8 (the sampled
        frames, in order) or every frame of the video (then indexed here). ``source_size`` = (width, height)
        of the video when the frames were already resized to the plan's size (a decoder resizing in its own
        process); otherwise the frames' own size."""
        picked = _sampled_frames(frames, sampling)
        width, height = source_size or (picked[0].shape[1], picked[0].shape[0])
        plan = self.plan(width, height, len(picked))
        return ProcessedVideo(
            pixel_values_videos=self._pixels(picked, plan),
            video_grid_thw=plan.grid_thw,
            sampling=sampling,
            plan=plan,
            times=self.times(sampling),
        )

    def times(self, sampling: Sampling) -> VideoTimes:
        """The groups' times, as ProcessedVideo gives them: known from the sampling alone."""
        group_times = self._group_times(sampling)
        second_per_grid_t = (
            self.settings.temporal_patch_size / sampling.sampled_fps
            if self.settings.time == "second_per_grid"
            else None
        )
        timestamps_s = (
            tuple((start + end) / 2 for start, end in group_times)
            if self.settings.time == "timestamps"
            else None
        )
        return VideoTimes(group_times, second_per_grid_t, timestamps_s)

    def group_frames(self, sampling: Sampling, groups: Sequence[int]) -> tuple[int, ...]:
        """The frame indices that make these temporal groups, ``temporal_patch_size`` a group: the last group
        of an odd count repeats the last frame, as transformers pads it."""
        tps, indices = self.settings.temporal_patch_size, sampling.frame_indices
        return tuple(indices[min(j, len(indices) - 1)] for g in groups for j in range(g * tps, (g + 1) * tps))

    def group_pixels(self, frames: np.ndarray, plan: VideoPlan) -> list[torch.Tensor]:
        """One pixel_values tensor per temporal group, for ``frames`` = (k * temporal_patch_size, H, W, 3)
        uint8 (group_frames' frames, in order): each equal to that group's rows of preprocess()'s
        pixel_values_videos, since every step is per frame or, in patchify, per group."""
        rows = self._pixels(list(frames), plan, groups=len(frames) // self.settings.temporal_patch_size)
        per_group = 1 if self.settings.resize == "tile" else plan.grid_thw[1] * plan.grid_thw[2]
        return [rows[k : k + per_group] for k in range(0, rows.shape[0], per_group)]

    def _pixels(
        self, picked: Sequence[np.ndarray], plan: VideoPlan, groups: int | None = None
    ) -> torch.Tensor:
        """Resize, normalise and (patches) patchify frames into pixel_values_videos rows for ``groups``
        temporal groups (None: the plan's)."""
        resized = np.stack([resize_uint8(frame, plan.resized_size) for frame in picked])  # (n, h, w, C) uint8
        normalized = np.empty((resized.shape[0], 3, *resized.shape[1:3]), dtype=np.float32)  # (n, C, h, w)
        for c in range(3):
            np.take(self.values[c], resized[..., c], out=normalized[:, c])
        pixels = torch.from_numpy(normalized)
        if self.settings.resize == "tile":
            return pixels
        return self._patchify(pixels, plan, plan.grid_thw[0] if groups is None else groups)

    def groups(self, video: ProcessedVideo) -> Iterator[VideoGroup]:
        """The video's temporal groups in order, each of grid (1, h, w): encoding them one by one gives the
        whole video's embeddings, because the towers never attend across time (docs/processing.md)."""
        count, h, w = video.video_grid_thw
        rows = 1 if self.settings.resize == "tile" else h * w  # rows of pixel_values_videos per group
        for index, (start_s, end_s) in enumerate(video.group_times):
            yield VideoGroup(
                index=index,
                count=count,
                pixel_values=video.pixel_values_videos[index * rows : (index + 1) * rows],
                grid_thw=(1, h, w),
                num_tokens=video.plan.group_tokens,
                start_s=start_s,
                end_s=end_s,
            )

    def clamp_info(self) -> dict[str, Any]:
        """The resolved video settings, for the start-up banner and /v1/info."""
        s = self.settings
        return {
            "family": s.family,
            "sampler": s.sampling.sampler,
            "default_fps": s.sampling.default_fps,
            "min_frames": s.sampling.min_frames,
            "max_frames": s.sampling.max_frames,
            "max_tokens_per_group": self.budget_tokens,
            "max_video_tokens": self.max_video_tokens,
            "min_pixels": s.min_pixels,
            "max_pixels": s.max_pixels,  # as shipped; the per-video clamp is in each plan's longest_edge
            "pixels_bound": s.resize,
            "cap_pixels_per_frame": s.cap_pixels_per_frame,
            "settings_from": s.source,
        }

    def _patchify(self, pixels: torch.Tensor, plan: VideoPlan, t: int) -> torch.Tensor:
        """(n, C, H, W) float32 -> (t*gh*gw, C*tps*P*P) in transformers' patchify order."""
        s = self.settings
        tps, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
        if pad := -pixels.shape[0] % tps:  # an odd count repeats the last frame, as transformers does
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        _, h, w = plan.grid_thw
        channels = pixels.shape[1]
        patches = pixels.view(t, tps, channels, h // m, m, p, w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, tps, p, p)
        return patches.reshape(t * h * w, channels * tps * p * p)

    def _group_times(self, sampling: Sampling) -> tuple[tuple[float, float], ...]:
        """(start_s, end_s) per group: index / source fps of its first and last frame, the last group padded
        with the last frame as the pixels are."""
        tps = self.settings.temporal_patch_size
        indices = list(sampling.frame_indices)
        indices += indices[-1:] * (-len(indices) % tps)
        times = [i / sampling.source_fps for i in indices]
        return tuple((times[g], times[g + tps - 1]) for g in range(0, len(times), tps))


def _sampled_frames(frames: np.ndarray | Sequence[np.ndarray], sampling: Sampling) -> list[np.ndarray]:
    """The sampled frames, checked: all of the video's (then indexed) or exactly the sampled ones."""
    indices = sampling.frame_indices
    count = len(frames)
    if count == sampling.total_frames and count != len(indices):
        picked = [frames[i] for i in indices]
    elif count == len(indices):
        picked = list(frames)
    else:
        raise InvalidVideoSampling(
            f"{count} frames were decoded for the {len(indices)} sampled of a video of {sampling.total_frames}; "
            "a video shorter than its header says is refused, never encoded short"
        )
    for frame in picked:
        if (
            frame.dtype != np.uint8
            or frame.ndim != 3
            or frame.shape[2] != 3
            or frame.shape != picked[0].shape
        ):
            raise InvalidVideoSampling(
                f"video frames must be (H, W, 3) uint8 RGB of one size; got {frame.dtype} {frame.shape}"
            )
    return picked


def load_video_processor(
    name_or_path: str | Path,
    budget_tokens: int = 0,
    max_video_tokens: int = 0,
    family: str | None = None,
) -> VideoProcessor:
    """The video processor of a checkpoint directory (read offline), a family name, or "demo".

    ``budget_tokens`` (--visual_batch_max_tokens) caps one temporal group, ``max_video_tokens``
    (--max_video_tokens) a whole video; 0 = no cap. ``family``: None reads it from the checkpoint.
    """
    checkpoint = Checkpoint.open(name_or_path, family or "auto") if Path(name_or_path).is_dir() else None
    image = load_image_processor(
        checkpoint or str(name_or_path), budget_tokens, family=family or "auto", resize="torch"
    )
    return VideoProcessor(video_settings(image.family, checkpoint, image), budget_tokens, max_video_tokens)
