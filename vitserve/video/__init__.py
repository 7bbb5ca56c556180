"""Videos: frame sampling and pixels equal to transformers' video processors, under the token budgets, and
the cut into temporal groups that the queue takes as items (docs/processing.md "Video").

Usage: ``proc = load_video_processor(checkpoint_dir | family | "demo", budget_tokens, max_video_tokens)``,
``sampling = proc.sample(total_frames, source_fps, fps=..., num_frames=...)``,
``video = proc.preprocess(frames, sampling)``, ``for group in proc.groups(video): ...``.
"""

from __future__ import annotations

from vitserve.video.plan import VideoPlan
from vitserve.video.processor import ProcessedVideo, VideoGroup, VideoProcessor, load_video_processor
from vitserve.video.sampling import Sampling, SamplingRules

__all__ = [
    "ProcessedVideo",
    "Sampling",
    "SamplingRules",
    "VideoGroup",
    "VideoPlan",
    "VideoProcessor",
    "load_video_processor",
]
