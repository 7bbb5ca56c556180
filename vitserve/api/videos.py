"""The videos of an /encode request: decoded in the decoder pool, sampled and preprocessed here, cut into
temporal groups that the engine queues as items (docs/video.md).

Per video, on the preprocessing pool (one thread per video, the decoding itself in a decoder process):
probe (container header, frame count: the limits of --max_video_bytes, --max_video_duration_s,
--max_video_frames, --max_image_pixels) -> the frame indices the family's transformers video processor
samples -> the resize plan under --visual_batch_max_tokens (per group) and --max_video_tokens (the video)
-> decode only those frames, resized to the plan's size in the decoder process -> pixels -> groups.

Videos run on their own threads, one per decoder slot, not on the image pool: a thread waits on its decoder
process for most of a video's time, and images must not wait behind that. The video processor and the
decoder processes start on the first video a server sees: a server that is never sent a video spawns no
decoder.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vitserve.api.inputs import VideoSource
from vitserve.config import Config
from vitserve.contract import ImageResult, PreparedImage, PreparedVideo, ProcessedImage
from vitserve.errors import InvalidVideo, Timeout, VitserveError
from vitserve.processors.base import VisionProcessor
from vitserve.video import VideoDecoder, VideoGroup, VideoLimits, VideoProcessor
from vitserve.video.settings import video_settings


class VideoFrontEnd:
    """The server's video processor and decoder pool, both made on first use; thread-safe."""

    def __init__(self, config: Config, processor: VisionProcessor):
        self.config = config
        self.image_processor = processor
        self._lock = threading.Lock()
        self._processor: VideoProcessor | None = None
        self._decoder: VideoDecoder | None = None
        # decoder processes (--video_decoders): videos decode that many at a time, the rest wait for a slot.
        # The threads start with the first video, one per decoder slot (more would only queue for a slot).
        self.slots = config.video_decoders
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="vitserve-video")

    def processor(self) -> VideoProcessor:
        with self._lock:
            if self._processor is None:
                image = self.image_processor
                settings = video_settings(image.family, image.checkpoint, image)
                self._processor = VideoProcessor(
                    settings, self.config.budget_tokens, self.config.max_video_tokens
                )
            return self._processor

    def decoder(self) -> VideoDecoder:
        with self._lock:
            if self._decoder is None:
                self._decoder = VideoDecoder(self.slots, limits=VideoLimits.from_config(self.config))
            return self._decoder

    def prepare(self, data: bytes, source: VideoSource, deadline: float) -> PreparedVideo:
        """One video ready for the engine (blocking: prepare_all runs it on the video threads)."""
        t0 = time.perf_counter()
        proc, decoder = self.processor(), self.decoder()
        video_id = hashlib.sha256(data).hexdigest()
        info = decoder.probe(data, deadline_s=_remaining(deadline))
        sampling = proc.sample(info.total_frames, info.fps, fps=source.fps, num_frames=source.num_frames)
        plan = proc.plan(info.width, info.height, len(sampling.frame_indices))
        frames = decoder.decode(
            data, sampling.frame_indices, plan.resized_size, deadline_s=_remaining(deadline)
        )
        t1 = time.perf_counter()
        video = proc.preprocess(frames, sampling, source_size=(info.width, info.height))
        if video.plan != plan:  # the plan is a pure function of the same inputs: a vitserve bug (500) if not
            raise VitserveError(
                f"the video's plan changed between decoding and preprocessing: {plan} {video.plan}"
            )
        content = f"{video_id}|{list(sampling.frame_indices)}|{list(plan.resized_size)}"
        groups = tuple(
            _group_image(group, content, plan.resized_size, plan.clamped) for group in proc.groups(video)
        )
        metadata: dict[str, Any] = {
            "video_id": video_id,
            "source_fps": info.fps,
            "total_frames": info.total_frames,
            "duration_s": info.duration_s,
            "frame_indices": list(sampling.frame_indices),
            "sampled_fps": sampling.sampled_fps,
            "grid_thw": list(video.video_grid_thw),
            "num_tokens": video.num_tokens,
            "resized_size": list(plan.resized_size),
            "clamped": plan.clamped,
        }
        if video.second_per_grid_t is not None:
            metadata["second_per_grid_t"] = video.second_per_grid_t
        if video.timestamps_s is not None:
            metadata["timestamps_s"] = list(video.timestamps_s)
        t2 = time.perf_counter()
        return PreparedVideo(groups, video_id, metadata, video.group_times, t1 - t0, t2 - t1)

    async def prepare_all(
        self, blobs: list[bytes], sources: list[VideoSource], deadline: float
    ) -> list[PreparedVideo]:
        """Every video of a request, concurrently on the video threads; the first bad one (in request order)
        raises, naming its index as ``video_index``."""
        loop = asyncio.get_running_loop()
        jobs = [
            loop.run_in_executor(self._pool, self.prepare, data, src, deadline)
            for data, src in zip(blobs, sources, strict=True)
        ]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*jobs, return_exceptions=True), max(deadline - time.monotonic(), 0)
            )
        except TimeoutError:
            raise Timeout("decoding the videos passed the deadline (--request_timeout_s)") from None
        for index, result in enumerate(results):
            if isinstance(result, VitserveError):
                raise result.with_video_index(index)
            if isinstance(result, BaseException):
                raise InvalidVideo(
                    f"the video could not be preprocessed ({type(result).__name__}: {result})"
                ).with_video_index(index) from result
        return results  # type: ignore[return-value]  # every exception was raised above

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._decoder is not None:
                self._decoder.close()
                self._decoder = None


def _group_image(group: VideoGroup, content: str, size: tuple[int, int], clamped: bool) -> PreparedImage:
    """A temporal group as the engine's queue item. Its id hashes the video's bytes and every setting that
    changes its pixels (the sampled frames, the resized size) with its place, so equal groups are encoded
    once and cached, and groups of differently sampled or clamped videos never share an entry."""
    item = ProcessedImage(
        pixel_values=group.pixel_values.contiguous(),
        grid_thw=group.grid_thw,
        num_tokens=group.num_tokens,
        resized_size=size,
        clamped=clamped,
    )
    image_id = hashlib.sha256(f"video|{content}|{group.index}/{group.count}".encode()).hexdigest()
    return PreparedImage(item, image_id, size, 0.0, 0.0)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout("decoding the video passed the deadline (--request_timeout_s)")
    return left


def video_body(
    index: int,
    video: PreparedVideo,
    results: list[ImageResult],
    tensor_json: Callable[[torch.Tensor], dict[str, Any]],
) -> dict[str, Any]:
    """A video's entry of the /encode response: its metadata, and with return_embeddings its groups'
    embeddings joined in time order (and Qwen3-VL's deepstack features, level by level)."""
    out: dict[str, Any] = {"index": index, **video.metadata}
    out["cached"] = all(r.cached for r in results)
    out["delivered"] = all(r.delivered for r in results)
    if results and results[0].embedding is not None:
        out["embedding"] = tensor_json(torch.cat([r.embedding for r in results if r.embedding is not None]))
        levels = len(results[0].deepstack)
        if levels:
            out["deepstack"] = [
                tensor_json(torch.cat([r.deepstack[k] for r in results])) for k in range(levels)
            ]
    return out
