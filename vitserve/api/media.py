"""The one media pipeline every route and LLM transport calls: from an admitted request to encoded items.

admit (a full queue refuses before any decoding) -> fetch URLs -> prepare every image (api/preprocess.py's
pool) and every video (api/videos.py) -> the route's own checks of what was prepared -> the engine (queue,
budget, cache claims, dedup, collect) -> `Encoded`: the request's items (EncodeRequest.items: every image,
then every video's groups in time order) with their results.

All-or-nothing: a bad image or video anywhere means nothing is queued. The handlers (api/encode.py,
api/chat.py) only parse their body and render their answer. One deadline rule: the request's deadline is set
by the handler from --request_timeout_s; the engine enforces it, and `DEADLINE_GRACE_S` after it the pipeline
gives up on an engine that did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from vitserve.api.inputs import ImageSource, VideoSource, fetch_sources
from vitserve.api.preprocess import Preprocessor
from vitserve.api.videos import VideoFrontEnd
from vitserve.config import Config
from vitserve.contract import EncodeRequest, Engine, ItemResult, PreparedImage, PreparedVideo, RequestItem
from vitserve.errors import InvalidRequest, Timeout, VitserveError
from vitserve.metrics import Metrics

T = TypeVar("T")
# The engine enforces a request's deadline; this much later the pipeline stops waiting for an engine that
# did not (a backstop, never the rule).
DEADLINE_GRACE_S = 5.0
# A JSON body up to this size is parsed (JSON + base64) on the event loop, and a response without
# embeddings is built there: well under a millisecond of work, less than the hop to the pool and back
# (~0.25 ms on an idle machine, several ms on a loaded one). Larger bodies and embeddings go to the pool.
INLINE_BODY_BYTES = 64 * 1024


# Per image, by its bytes' sha256 (request order): True when the LLM side holds its embedding already, so it
# is neither decoded nor encoded (a chat hand-over that `reuses`, handover/base.py Handover.held).
Held = Callable[[list[str]], Awaitable[list[bool]]]


@dataclass(frozen=True)
class Media:
    """What a route found in its body: the images' and the videos' sources, each kind in request order, and
    the route's own checks of them."""

    request_id: str
    images: Sequence[ImageSource]
    videos: Sequence[VideoSource] = ()
    return_embeddings: bool = False
    traceparent: str | None = None
    held: Held | None = None  # asked before decoding; None: every image is encoded
    check_video: Callable[[PreparedVideo], None] | None = None  # refuses a prepared video; None: none refused


@dataclass(frozen=True)
class Encoded:
    """A request's items and the engine's result for each, in EncodeRequest.items order (None for an item
    handed over already)."""

    request: EncodeRequest
    results: list[ItemResult | None]

    def walk(self) -> Iterator[tuple[RequestItem, ItemResult | None]]:
        """Each item with its result, in the one order (what the renderers walk)."""
        return zip(self.request.items, self.results, strict=True)

    def encoded(self) -> tuple[list[tuple[PreparedImage, ItemResult]], list[list[ItemResult]]]:
        """For a request the engine did whole (/encode's): each image with its result, and each video's
        groups' results in time order."""
        images: list[tuple[PreparedImage, ItemResult]] = []
        videos: list[list[ItemResult]] = [[] for _ in self.request.videos]
        for item, result in self.walk():
            if item.prepared is None or result is None:
                raise ValueError(f"item {item.index} of {self.request.request_id} was handed over before")
            if item.group is None:
                images.append((item.prepared, result))
            else:
                videos[item.media_index].append(result)
        return images, videos


@dataclass
class MediaPipeline:
    """Prepares and encodes one request's media; owned by the server, shared by every route."""

    config: Config
    engine: Engine
    pre: Preprocessor  # the image pool (api/preprocess.py), also the routes' pool for CPU-heavy steps
    metrics: Metrics
    videos: VideoFrontEnd | None = None  # None: this server takes no videos (--video_decoders 0)

    def check_videos_served(self, count: int) -> None:
        """400 for a request with videos on a server that takes none, before anything is decoded."""
        if count and self.videos is None:
            raise InvalidRequest("this server takes no videos (--video_decoders 0)")

    async def prepare(self, media: Media, deadline: float) -> EncodeRequest:
        """Admit, fetch, decode and preprocess every image and video; the media's `check_video` refuses a
        prepared video (its error gets the video's index); its `held` is asked which images the LLM side
        holds already, by their bytes' sha256 (computed here once, and handed to the images then prepared
        too): those stay items of the request, at their index, handed over already (neither decoded nor
        encoded). Raises the first item's VitserveError (with the image's or video's index in the request),
        counted as rejected."""
        try:
            self.check_videos_served(len(media.videos))
            self.engine.admit(None)  # a full queue refuses before any decoding is spent
            blobs = await fetch_sources(list(media.images), self.config, deadline)
            video_blobs = await fetch_sources(list(media.videos), self.config, deadline)
            held, ids = await self._held(blobs, media.held)
            todo = [None if done else data for data, done in zip(blobs, held, strict=True)]
            prepared = await self.pre.prepare(todo, deadline, ids)
            videos: list[PreparedVideo] = []
            if media.videos and self.videos is not None:
                videos = await self.videos.prepare_all(video_blobs, list(media.videos), deadline)
            if media.check_video is not None:
                _check_each(videos, media.check_video)
        except VitserveError:
            self.metrics.images_total.labels(outcome="rejected").inc(len(media.images))
            raise
        count_accepted(self.metrics, [p for p in prepared if p is not None])
        return EncodeRequest(
            request_id=media.request_id,
            images=tuple(prepared),
            deadline=deadline,
            return_embeddings=media.return_embeddings,
            traceparent=media.traceparent,
            videos=tuple(videos),
        )

    async def encode(self, request: Request, work: EncodeRequest) -> Encoded | None:
        """The engine's results, or None when the client went away first (its queued items are withdrawn).
        Raises the engine's VitserveError (counted as rejected), or Timeout past the deadline's grace."""
        if not work.pending:  # every item was handed over already: nothing to encode
            return Encoded(work, [None] * len(work.items))
        timeout_s = work.deadline - time.monotonic() + DEADLINE_GRACE_S
        try:
            results = await unless_gone(request, self.engine.encode(work), timeout_s, self._late)
        except VitserveError:  # counted: the images given to the engine (docs/api.md, /metrics)
            given = sum(1 for item in work.items if item.group is None and not item.handed_over)
            self.metrics.images_total.labels(outcome="rejected").inc(given)
            raise
        return None if results is None else Encoded(work, results)

    async def _held(self, blobs: list[bytes], held: Held | None) -> tuple[list[bool], list[str] | None]:
        """Per image, whether the LLM side holds it already; and the images' sha256 when it was asked."""
        if held is None:
            return [False] * len(blobs), None
        digests = await self.pre.run(sha256_each, blobs)
        return await held(digests), digests

    def _late(self) -> VitserveError:
        return Timeout(f"no result within {self.config.request_timeout_s}s (--request_timeout_s)")


def _check_each(videos: list[PreparedVideo], check: Callable[[PreparedVideo], None]) -> None:
    for index, video in enumerate(videos):
        try:
            check(video)
        except VitserveError as err:
            raise err.with_video_index(index) from None


def sha256_each(blobs: list[bytes]) -> list[str]:
    """Each blob's hex sha256: the image_id the engine keys its cache with (processors/prepare.py)."""
    return [hashlib.sha256(data).hexdigest() for data in blobs]


def count_accepted(metrics: Metrics, prepared: Sequence[PreparedImage]) -> None:
    """Token and clamp metrics of images that passed preprocessing, whichever route they came by."""
    for p in prepared:
        metrics.image_tokens.observe(p.item.num_tokens)
        if p.item.clamped:
            metrics.images_clamped_total.inc()


async def unless_gone(
    request: Request, work: Coroutine[Any, Any, T], timeout_s: float, late: Callable[[], VitserveError]
) -> T | None:
    """`work`'s result, or None when the client closed the connection first. Either way nothing is left
    running: on a disconnect or after `timeout_s` (then `late()` is raised) the work is cancelled, and
    cancelling it withdraws what it queued (the engine removes a request's queued images; httpx closes an
    upstream connection, and the LLM server aborts the request)."""
    if await request.is_disconnected():  # left already: start nothing at all
        work.close()
        return None
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {task, gone}, timeout=max(timeout_s, 0), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, VitserveError):
        await task
    if gone in done:
        return None
    raise late()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body is already consumed, so receive() waits)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
