"""The videos of an /encode request: probed, sampled and planned here before the engine sees them; their
temporal groups' pixels decoded and preprocessed a chunk at a time as the engine asks (docs/video.md).

Per video, on the video threads (the decoding itself in a decoder process): probe (container header, frame
count: the limits of --max_video_bytes, --max_video_duration_s, --max_video_frames, --max_image_pixels) ->
the frame indices the family's transformers video processor samples -> the resize plan under
--visual_batch_max_tokens (per group) and --max_video_tokens (the video) -> the groups, their ids and the
metadata, all known before a frame is decoded. Then, per chunk the engine asks for (VideoFeed: one batch's
worth of groups it must encode, none for cached ones) -> decode only those groups' frames, resized to the
plan's size in the decoder process -> pixels. So a video holds a few chunks in memory, never all of it.

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
from typing import Any, TypeVar

import numpy as np
import torch

from vitserve.api.inputs import VideoSource
from vitserve.config import Config
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo, ProcessedImage, VideoMetadata
from vitserve.errors import InvalidVideo, Timeout, VitserveError
from vitserve.processors.base import VisionProcessor
from vitserve.video import Sampling, VideoDecoder, VideoLimits, VideoPlan, VideoProcessor
from vitserve.video.memory import pin_mmap_threshold
from vitserve.video.settings import video_settings

T = TypeVar("T")

CHUNK_GROUPS = 16  # groups per decoded chunk when no --visual_batch_max_tokens bounds a batch


class VideoFrontEnd:
    """The server's video processor and decoder pool, both made on first use; thread-safe."""

    def __init__(self, config: Config, processor: VisionProcessor):
        self.config = config
        self.image_processor = processor
        self._lock = threading.Lock()
        self._processor: VideoProcessor | None = None
        self._decoder: VideoDecoder | None = None
        self.decodes = 0  # decoder calls for frames (chunks) so far; a probe is not one
        # decoder processes (--video_decoders): videos decode that many at a time, the rest wait for a slot.
        # The threads start with the first video, one per decoder slot (more would only queue for a slot).
        self.slots = config.video_decoders
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="vitserve-video")

    def processor(self) -> VideoProcessor:
        with self._lock:
            if self._processor is None:
                pin_mmap_threshold()  # the chunks a video's groups are made in are freed to the OS
                image = self.image_processor
                settings = video_settings(image.family, image.checkpoint, image)
                self._processor = VideoProcessor(
                    settings, self.config.visual_batch_max_tokens, self.config.max_video_tokens
                )
            return self._processor

    def decoder(self) -> VideoDecoder:
        with self._lock:
            if self._decoder is None:
                self._decoder = VideoDecoder(self.slots, limits=VideoLimits.from_config(self.config))
            return self._decoder

    def prepare(self, data: bytes, source: VideoSource, deadline: float, index: int = 0) -> PreparedVideo:
        """One video ready for the engine (blocking: prepare_all runs it on the video threads): probed,
        sampled and planned, its groups' pixels left to its feed (made a chunk at a time as the engine
        asks for them, and never for groups the cache holds)."""
        t0 = time.perf_counter()
        proc, decoder = self.processor(), self.decoder()
        video_id = hashlib.sha256(data).hexdigest()
        info = decoder.probe(data, deadline_s=_remaining(deadline))
        sampling = proc.sample(info.total_frames, info.fps, fps=source.fps, num_frames=source.num_frames)
        plan = proc.plan(info.width, info.height, len(sampling.frame_indices))
        t1 = time.perf_counter()
        times = proc.times(sampling)
        content = f"{video_id}|{list(sampling.frame_indices)}|{list(plan.resized_size)}"
        count, h, w = plan.grid_thw
        groups = tuple(
            _group_image(k, count, (1, h, w), plan.group_tokens, content, plan.resized_size, plan.clamped)
            for k in range(count)
        )
        metadata = VideoMetadata(
            video_id=video_id,
            source_fps=info.fps,
            total_frames=info.total_frames,
            duration_s=info.duration_s,
            frame_indices=tuple(sampling.frame_indices),
            sampled_fps=sampling.sampled_fps,
            grid_thw=plan.grid_thw,
            num_tokens=plan.num_tokens,
            resized_size=plan.resized_size,
            clamped=plan.clamped,
            second_per_grid_t=times.second_per_grid_t,
            timestamps_s=times.timestamps_s,
        )
        feed = VideoFeed(self, data, sampling, plan, deadline, index)
        return PreparedVideo(groups, metadata, times.group_times, t1 - t0, 0.0, feed)

    async def on_video_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the video threads (never the image pool, never the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def decode_frames(
        self, data: bytes, indices: tuple[int, ...], size: tuple[int, int], deadline_s: float
    ) -> np.ndarray:
        """The frames at `indices`, resized to `size`, from a decoder process; counted in `decodes`."""
        with self._lock:
            self.decodes += 1
        return self.decoder().decode(data, indices, size, deadline_s=deadline_s)

    def chunk_groups(self, group_tokens: int) -> int:
        """Groups per chunk: one batch's worth (their tokens within --visual_batch_max_tokens, at most
        --visual_infer_batch_size; CHUNK_GROUPS without a budget), at least one."""
        config = self.config
        fit = (
            config.visual_batch_max_tokens // max(group_tokens, 1) if config.budget_enabled else CHUNK_GROUPS
        )
        return max(1, min(fit, config.visual_infer_batch_size))

    async def prepare_all(
        self, blobs: list[bytes], sources: list[VideoSource], deadline: float
    ) -> list[PreparedVideo]:
        """Every video of a request, concurrently on the video threads; the first bad one (in request order)
        raises, naming its index as ``video_index``."""
        jobs = [
            self.on_video_thread(self.prepare, data, src, deadline, index)
            for index, (data, src) in enumerate(zip(blobs, sources, strict=True))
        ]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*jobs, return_exceptions=True), max(deadline - time.monotonic(), 0)
            )
        except TimeoutError:
            raise Timeout("decoding the videos passed the deadline (--request_timeout_s)") from None
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                raise _video_error(result, index) from _cause(result)
        return results  # type: ignore[return-value]  # every exception was raised above

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._decoder is not None:
                self._decoder.close()
                self._decoder = None


class VideoFeed:
    """The GroupFeed of one video (contract.GroupFeed): the groups the engine asks for, decoded in the
    decoder pool (only their frames, seeking) and preprocessed on the video threads, a chunk per call."""

    def __init__(
        self,
        front: VideoFrontEnd,
        data: bytes,
        sampling: Sampling,
        plan: VideoPlan,
        deadline: float,
        index: int,
    ) -> None:
        self._front, self._data, self._sampling, self._plan = front, data, sampling, plan
        self._deadline, self._index = deadline, index
        self.chunk_groups = front.chunk_groups(plan.group_tokens)
        self._decode_s = self._preprocess_s = 0.0

    async def pixels(self, groups: list[int]) -> list[torch.Tensor]:
        try:
            return await self._front.on_video_thread(self._make, groups)
        except Exception as exc:
            raise _video_error(exc, self._index) from _cause(exc)

    def times(self) -> tuple[float, float]:
        return self._decode_s, self._preprocess_s

    def _make(self, groups: list[int]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        proc = self._front.processor()
        indices = proc.group_frames(self._sampling, groups)
        frames = self._front.decode_frames(
            self._data, indices, self._plan.resized_size, _remaining(self._deadline)
        )
        t1 = time.perf_counter()
        pixels = proc.group_pixels(frames, self._plan)
        self._decode_s += t1 - t0
        self._preprocess_s += time.perf_counter() - t1
        return pixels


def _group_image(
    index: int,
    count: int,
    grid_thw: tuple[int, int, int],
    tokens: int,
    content: str,
    size: tuple[int, int],
    clamped: bool,
) -> PreparedImage:
    """A temporal group as the engine's queue item, its pixels still empty (the feed fills them). Its id
    hashes the video's bytes and every setting that changes its pixels (the sampled frames, the resized
    size) with its place, so equal groups are encoded once and cached, and groups of differently sampled
    or clamped videos never share an entry."""
    item = ProcessedImage(
        pixel_values=torch.empty(0),
        grid_thw=grid_thw,
        num_tokens=tokens,
        resized_size=size,
        clamped=clamped,
    )
    image_id = hashlib.sha256(f"video|{content}|{index}/{count}".encode()).hexdigest()
    return PreparedImage(item, image_id, size, 0.0, 0.0)


def _video_error(exc: BaseException, index: int) -> VitserveError:
    """What a video's failure answers, naming its ``video_index``: vitserve's own error as it is, anything
    else (a bug in the preprocessing of this video) as invalid_video."""
    if isinstance(exc, VitserveError):
        return exc.with_video_index(index)
    return InvalidVideo(
        f"the video could not be preprocessed ({type(exc).__name__}: {exc})"
    ).with_video_index(index)


def _cause(exc: BaseException) -> BaseException | None:
    """The traceback worth chaining: none for vitserve's own errors, the original for anything else."""
    return None if isinstance(exc, VitserveError) else exc


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout("decoding the video passed the deadline (--request_timeout_s)")
    return left


def video_body(
    index: int,
    video: PreparedVideo,
    results: list[ItemResult],
    tensor_json: Callable[[torch.Tensor], dict[str, Any]],
) -> dict[str, Any]:
    """A video's entry of the /encode response: its metadata, and with return_embeddings its groups'
    embeddings joined in time order (and Qwen3-VL's deepstack features, level by level)."""
    out: dict[str, Any] = {"index": index, **video.metadata.body()}
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
