"""Videos: frame sampling and pixels equal to transformers' video processors, under the token budgets, and
the cut into temporal groups that the queue takes as items (docs/processing.md "Video").

Usage: ``proc = load_video_processor(checkpoint_dir | family | "demo", budget_tokens, max_video_tokens)``,
``sampling = proc.sample(total_frames, source_fps, fps=..., num_frames=...)``,
``video = proc.preprocess(frames, sampling)``, ``for group in proc.groups(video): ...``.
Decoding: ``decoder = VideoDecoder(slots, limits=VideoLimits.from_config(config))``, ``info =
decoder.probe(data, deadline_s=...)``, ``frames = decoder.decode(data, indices, size, deadline_s=...)``.

The names load on first use (PEP 562): a decoder process, spawned, imports vitserve.video.decoder_pool without
transformers and the processors coming in through this file (they doubled its start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitserve.lazy import lazy_names

if TYPE_CHECKING:
    from vitserve.video.decode import VideoInfo, VideoLimits
    from vitserve.video.decoder_pool import VideoDecoder
    from vitserve.video.plan import VideoPlan
    from vitserve.video.processor import ProcessedVideo, VideoGroup, VideoProcessor, load_video_processor
    from vitserve.video.sampling import Sampling, SamplingRules

# public name -> module that defines it (one line a name; __all__ below lists the same names)
_LAZY = {
    "ProcessedVideo": "vitserve.video.processor",
    "Sampling": "vitserve.video.sampling",
    "SamplingRules": "vitserve.video.sampling",
    "VideoDecoder": "vitserve.video.decoder_pool",
    "VideoGroup": "vitserve.video.processor",
    "VideoInfo": "vitserve.video.decode",
    "VideoLimits": "vitserve.video.decode",
    "VideoPlan": "vitserve.video.plan",
    "VideoProcessor": "vitserve.video.processor",
    "load_video_processor": "vitserve.video.processor",
}

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


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
