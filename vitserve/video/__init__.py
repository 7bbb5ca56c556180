"""Videos: frame sampling and pixels equal to transformers' video processors, under the token budgets, and
the cut into temporal groups that the queue takes as items (docs/processing.md "Video").

Usage: ``proc = load_video_processor(checkpoint_dir | family | "demo", budget_tokens, max_video_tokens)``,
``sampling = proc.sample(total_frames, source_fps, fps=..., num_frames=...)``,
``video = proc.preprocess(frames, sampling)``, ``for group in proc.groups(video): ...``.
Decoding: ``decoder = VideoDecoder(slots, limits=VideoLimits.from_config(config))``, ``info =
decoder.probe(data, deadline_s=...)``, ``frames = decoder.decode(data, indices, size, deadline_s=...)``.
"""

from __future__ import annotations

from vitserve.video.decode import VideoInfo, VideoLimits
from vitserve.video.decoder import VideoDecoder
from vitserve.video.plan import VideoPlan
from vitserve.video.processor import ProcessedVideo, VideoGroup, VideoProcessor, load_video_processor
from vitserve.video.sampling import Sampling, SamplingRules

__all__ = [
    "ProcessedVideo",
    "Sampling",
    "SamplingRules",
    "VideoDecoder",
    "VideoGroup",
    "VideoInfo",
    "VideoLimits",
    "VideoPlan",
    "VideoProcessor",
    "load_video_processor",
]
