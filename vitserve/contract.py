"""The one contract between the HTTP front end and the engine, and the image types both sides share.

The API knows an engine only through `Engine` below; it never imports `vitserve.engine`, and the engine
never imports `vitserve.api`. The dataclasses say everything the API may know about the engine: what it
sends (`EncodeRequest`: its `RequestItem`s, each an image or a video's temporal group as a `PreparedImage`),
what it gets back (an `ItemResult` with `StageTimes` per item), and the engine's facts and health
(`EngineInfo`, `Readiness`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from vitserve.config import Config

T = TypeVar("T")


@dataclass
class ProcessedImage:
    """One image after the family's processor, ready for the encoder (docs/processing.md)."""

    pixel_values: torch.Tensor  # (num_patches, C*T*P*P) for Qwen families; (num_tiles, C, H, W) for InternVL
    grid_thw: tuple[int, int, int]  # patch grid before merge (InternVL: (num_tiles, h, w) of one tile)
    num_tokens: int  # merged tokens = rows of the embedding
    resized_size: tuple[int, int]  # (width, height) fed to the encoder
    clamped: bool  # True when the token budget shrank the image


@dataclass
class EncodedImage:
    """The encoder's output for one image."""

    embedding: torch.Tensor  # (num_tokens, dim)
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each (num_tokens, dim); Qwen3-VL/3.5 only


@dataclass(frozen=True)
class PreparedImage:
    """One image of a request, decoded and preprocessed: what the API hands the engine."""

    item: ProcessedImage
    image_id: str  # hex sha256 of the bytes as received (the engine's dedup and cache key)
    original_size: tuple[int, int]  # (width, height) after EXIF orientation
    decode_s: float
    preprocess_s: float
    draft_scale: int = 1  # 1, 2, 4 or 8: the reduced JPEG decode --jpeg_draft used (1 = full decode)


class GroupFeed(Protocol):
    """The pixels of a video's temporal groups, made on demand a chunk at a time (docs/video.md "Memory"):
    the engine asks only for the groups it must encode (none for a video whose groups are all cached), a
    chunk after the one before it left the queue, so a video's pixels in memory are bounded by the chunk,
    not by its length."""

    chunk_groups: int  # groups the engine asks for at a time

    async def pixels(self, groups: list[int]) -> list[torch.Tensor]:
        """The pixel_values of these groups (indices in time order), one tensor each; raises the video's
        VitserveError (its video_index set) when a frame cannot be decoded."""
        ...

    def times(self) -> tuple[float, float]:
        """(decode_s, preprocess_s) spent on the chunks so far."""
        ...


@dataclass(frozen=True)
class VideoMetadata:
    """What a video was made of, known before any frame is decoded: /encode's response says it (docs/api.md,
    in this order), and the hand-over reads its grid and its time fields."""

    video_id: str  # hex sha256 of the video bytes as received
    source_fps: float | None  # the stream's average frame rate; None: the container does not say
    total_frames: int  # counted by demuxing
    duration_s: float
    frame_indices: tuple[int, ...]  # the sampled frames, in time order
    sampled_fps: float
    grid_thw: tuple[int, int, int]  # (temporal groups, h, w) in patches, before the merge
    num_tokens: int  # rows of the whole video's embedding
    resized_size: tuple[int, int]  # (width, height) of every frame fed to the encoder
    clamped: bool  # shrunk to fit the budget
    second_per_grid_t: float | None = None  # Qwen2.5-VL's time per temporal group; None: not the family's
    timestamps_s: tuple[float, ...] | None = None  # Qwen3-VL / Qwen3.5's time of each group; None: likewise

    def body(self) -> dict[str, object]:
        """The fields as the response gives them (lists for tuples); a family's time field only when it has it."""
        out: dict[str, object] = {}
        for name, value in vars(self).items():
            if value is not None or name not in ("second_per_grid_t", "timestamps_s"):
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class PreparedVideo:
    """One video of a request, probed, sampled and planned: its temporal groups are queue items.

    Each group is a PreparedImage of grid (1, h, w) whose image_id is the sha256 of the video's bytes and of
    every setting that changes the group's pixels (frame indices, resized size, group index), so the engine
    deduplicates and caches groups as it does images (docs/video.md). With a ``feed``, the groups'
    pixel_values are empty until the engine fills them from it (and empties them again once encoded)."""

    groups: tuple[PreparedImage, ...]  # in time order
    metadata: VideoMetadata  # what the response says of the video (sampling, grid, sizes, times)
    group_times: tuple[tuple[float, float], ...]  # per group: (start_s, end_s)
    decode_s: float
    preprocess_s: float
    feed: GroupFeed | None = None  # None: every group's pixels are already there

    @property
    def video_id(self) -> str:
        return self.metadata.video_id

    @property
    def num_tokens(self) -> int:
        return sum(g.item.num_tokens for g in self.groups)

    def times(self) -> tuple[float, float]:
        """(decode_s, preprocess_s) in all: before the engine, and the feed's chunks."""
        decode_s, preprocess_s = self.feed.times() if self.feed is not None else (0.0, 0.0)
        return self.decode_s + decode_s, self.preprocess_s + preprocess_s


@dataclass(frozen=True)
class RequestItem:
    """One item of a request: an image, or one temporal group of a video, as vLLM keeps one record per
    multimodal item. `EncodeRequest.items` stores them once, in the one order every reader walks: the engine
    (queue, collect), the push to the LLM, and the renderers of /encode's response and of chat's rewrite."""

    index: int  # its place in EncodeRequest.items (and in the engine's results, and on the LLM wire)
    # the image, or the group as an image of grid (1, h, w); None: an item whose hand-over is already done
    # (--llm_transport ec_storage: the image's file is there), neither decoded, nor encoded, nor sent
    prepared: PreparedImage | None
    modality: Literal["image", "video"]
    media_index: int  # the image's index among the request's images, or the video's among its videos
    group: int | None = None  # a video's group index, in time order; None for an image
    num_groups: int = 0  # the video's groups in all (0 for an image)
    video_id: str = ""  # the video's sha256 ("" for an image)
    start_s: float = 0.0  # the group's time range in the video (0 for an image)
    end_s: float = 0.0

    @property
    def handed_over(self) -> bool:
        """The LLM has this item already: the engine skips it, and its result is None."""
        return self.prepared is None


@dataclass(frozen=True)
class EncodeRequest:
    """Every image and video of one HTTP request, and `items`, the list of them built once from those: every
    image, then every temporal group of each video. The engine answers one ItemResult per item, in that
    order (None for an item handed over already)."""

    request_id: str
    images: tuple[PreparedImage | None, ...]  # per image of the request; None: handed over already
    deadline: float  # time.monotonic() based
    return_embeddings: bool
    traceparent: str | None = (
        None  # W3C trace context: the caller's trace id, vitserve's span id; travels in the wire header
    )
    videos: tuple[PreparedVideo, ...] = ()
    items: tuple[RequestItem, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        out = [RequestItem(i, image, "image", i) for i, image in enumerate(self.images)]
        for v, video in enumerate(self.videos):
            for g, (group, (start_s, end_s)) in enumerate(zip(video.groups, video.group_times, strict=True)):
                out.append(
                    RequestItem(
                        len(out), group, "video", v, g, len(video.groups), video.video_id, start_s, end_s
                    )
                )
        object.__setattr__(self, "items", tuple(out))  # frozen: set once, here

    @property
    def pending(self) -> bool:
        """Some item still needs its hand-over (False: nothing for the engine to do)."""
        return any(not item.handed_over for item in self.items)


@dataclass(frozen=True)
class StageTimes:
    """Milliseconds one item spent in each engine stage (zero for a stage it skipped)."""

    queue_ms: float = 0.0
    encode_ms: float = 0.0
    send_ms: float = 0.0


@dataclass(frozen=True)
class ItemResult:
    """The engine's answer for one item of a request (an image, or a video's temporal group)."""

    num_tokens: int
    embedding: torch.Tensor | None  # (num_tokens, dim); None unless return_embeddings was asked
    deepstack: tuple[torch.Tensor, ...] = ()  # each (num_tokens, dim)
    cached: bool = False  # a cache hit, or another request's encode of the same item
    delivered: bool = False  # the LLM receiver acknowledged it (always False without --llm_endpoint)
    timing: StageTimes = StageTimes()


@dataclass(frozen=True)
class EngineInfo:
    """What the encoder ranks reported at start-up: the banner and /v1/info show it."""

    model: str
    family: str
    embed_dim: int
    dtype: str
    tp: int
    dp: int
    reserved_memory_bytes: dict[int, int]  # global rank -> bytes reserved for the worst-case batch
    reserved_source: Literal["stress", "override"]
    # everything besides an image's bytes that decides its embedding (the weights' content digest, budget,
    # resize, dtype, versions: the engine cache's fingerprint); "" until the ranks are ready
    fingerprint: str = ""
    # --visual_mem_gb alone: why the budget (the target, the model's prediction there, the budgets measured
    # behind it, which limit bound it), from the first rank; None otherwise
    sizing: dict[str, Any] | None = None


@dataclass(frozen=True)
class Readiness:
    """Whether the engine can take work now, and if not, why (the /ready body says it)."""

    ready: bool
    reason: str


class Engine(Protocol):
    """What the API and the Service call. Every method runs on the event loop that called start()."""

    failed: asyncio.Event  # set when no encoder group is left: the Service exits with code 1

    async def start(self) -> Config:
        """Start every encoder group; once all are ready, return the Config to serve with (with --visual_mem_gb
        alone, the budget the ranks chose), or raise ConfigError naming the flag."""

    async def shutdown(self) -> None:
        """Stop taking work, stop the groups, remove what start() made. Safe to call twice or unstarted."""

    def admit(self, tokens: int | None) -> None:
        """Raise NotReady, EncoderFailed or QueueFull (with Retry-After) when `tokens` more queued tokens
        cannot be taken now. None: the tokens are not known yet (before decoding), count at least one."""

    async def encode(self, request: EncodeRequest) -> list[ItemResult | None]:
        """Encode (or reuse) every item of `request.items` (each image, each video group), push each to the
        LLM in that order, and return one result per item: None for an item handed over already."""

    def readiness(self) -> Readiness: ...

    def info(self) -> EngineInfo:
        """The ranks' facts; raises NotReady before start() has returned."""
