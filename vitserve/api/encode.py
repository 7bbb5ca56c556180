"""POST /encode: read -> parse -> fetch -> decode+preprocess ALL -> engine -> respond (docs/api.md).

All-or-nothing: every image and video is validated, decoded and preprocessed before anything is enqueued,
so a bad image or video anywhere in the request means nothing is encoded and nothing reaches the LLM.
Videos go through api/videos.py; their temporal groups come back from the engine after the images, and
are joined here into one embedding per video (docs/video.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vitserve.api.body import ClientGone, read_body
from vitserve.api.inputs import (
    ParsedRequest,
    fetch_sources,
    media_type,
    parse_json_body,
    parse_multipart_body,
)
from vitserve.api.pipeline import Preprocessor
from vitserve.api.tracing import RequestTrace, Tracing
from vitserve.api.videos import VideoFrontEnd, video_body
from vitserve.config import Config
from vitserve.contract import EncodeRequest, Engine, ImageResult, PreparedImage, PreparedVideo
from vitserve.errors import InvalidRequest, Timeout, VitserveError
from vitserve.metrics import Metrics
from vitserve.rpc.tensors import dtype_name, tensor_to_buffer

log = logging.getLogger(__name__)
T = TypeVar("T")
_DEADLINE_GRACE_S = 5.0  # the engine enforces the deadline; this only guards against an engine that does not
# A JSON body up to this size is parsed (JSON + base64) on the event loop, and a response without
# embeddings is built there: well under a millisecond of work, less than the hop to the pool and back
# (~0.25 ms on an idle machine, several ms on a loaded one). Larger bodies and embeddings go to the pool.
INLINE_BODY_BYTES = 64 * 1024


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return {
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "b64": base64.b64encode(tensor_to_buffer(t)).decode(),
    }


class EncodeHandler:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        preprocessor: Preprocessor,
        metrics: Metrics,
        tracing: Tracing,
        videos: VideoFrontEnd | None = None,
    ):
        self.config = config
        self.engine = engine
        self.pre = preprocessor
        self.metrics = metrics
        self.tracing = tracing
        self.videos = videos  # None: this server takes no videos

    async def __call__(self, request: Request) -> Response:
        """The request under its trace context: the `traceparent` response header (error responses get it
        from request.state in app.py) and, with --otlp_endpoint, its spans (api/tracing.py)."""
        trace = self.tracing.start(request.headers.get("traceparent"))
        request.state.traceparent = trace.traceparent
        try:
            response = await self._handle(request, trace)
        except Exception as exc:
            trace.finish(exc.status if isinstance(exc, VitserveError) else 500)
            raise
        trace.finish(response.status_code)
        response.headers["traceparent"] = trace.traceparent
        return response

    async def _handle(self, request: Request, trace: RequestTrace) -> Response:
        deadline = time.monotonic() + self.config.request_timeout_s
        clock = _StageClock(self.metrics)
        parsed: ParsedRequest | None = None
        try:
            parsed = await self._parse_within(request, deadline, clock)
            self._check_videos_served(parsed)
            self.engine.admit(None)  # a full queue refuses before any decoding is spent
            trace.mark("decode")
            blobs = await fetch_sources(parsed.sources, self.config, deadline)
            video_blobs = await fetch_sources(parsed.videos, self.config, deadline)
            prepared = await self.pre.prepare(blobs, deadline)
            videos: list[PreparedVideo] = []
            if parsed.videos and self.videos is not None:
                videos = await self.videos.prepare_all(video_blobs, parsed.videos, deadline)
            clock.lap("prepare")
            count_accepted(self.metrics, prepared)
            trace.mark("engine")
            results = await self._encode(request, parsed, prepared, videos, deadline, trace.traceparent)
            clock.lap("engine")
        except VitserveError:
            n = len(parsed.sources) if parsed else 0
            self.metrics.images_total.labels(outcome="rejected").inc(n)
            raise
        except ClientGone:
            return Response(status_code=499)
        if results is None:
            log.info(
                "request %s: client disconnected while queued; its images were withdrawn", parsed.request_id
            )
            return Response(status_code=499)
        trace.record(parsed.request_id, prepared, results[: len(prepared)])
        if parsed.return_embeddings:  # base64 of every embedding: CPU work for the pool
            body = await self.pre.run(self._response_body, parsed, prepared, results, videos)
        else:
            body = self._response_body(parsed, prepared, results, videos)
        response = JSONResponse(body)
        clock.lap("respond")
        clock.total("request")
        return response

    def _check_videos_served(self, parsed: ParsedRequest) -> None:
        if not parsed.videos:
            return
        if self.videos is None:
            raise InvalidRequest("this server takes no videos (--video_decoders 0)")

    async def _parse_within(self, request: Request, deadline: float, clock: _StageClock) -> ParsedRequest:
        """A body that trickles in (slowloris) is bounded by the request deadline too."""
        try:
            return await asyncio.wait_for(self._parse(request, clock), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise Timeout(
                f"the request body did not arrive within {self.config.request_timeout_s}s "
                "(--request_timeout_s)"
            ) from None

    async def _parse(self, request: Request, clock: _StageClock) -> ParsedRequest:
        body = await read_body(request, self.config.max_request_bytes)
        clock.lap("read")
        kind = media_type(request)
        if kind == "multipart/form-data":
            parsed = await self.pre.run(parse_multipart_body, request.headers, body, self.config)
            clock.lap("parse")
            return parsed
        if kind not in ("", "application/json") and not kind.endswith("+json"):
            raise InvalidRequest(
                f"unsupported Content-Type {kind!r}; send application/json or multipart/form-data"
            )
        if not body:
            raise InvalidRequest("empty request body")
        if len(body) <= INLINE_BODY_BYTES:
            parsed = parse_json_body(body, self.config)
        else:
            parsed = await self.pre.run(parse_json_body, body, self.config)
        clock.lap("parse")
        return parsed

    async def _encode(
        self,
        request: Request,
        parsed: ParsedRequest,
        prepared: list[PreparedImage],
        videos: list[PreparedVideo],
        deadline: float,
        traceparent: str,
    ) -> list[ImageResult] | None:
        """The engine's results (the images', then every video group's), or None when the client went away
        first (its queued work is cancelled)."""
        work = self.engine.encode(
            EncodeRequest(
                request_id=parsed.request_id,
                images=tuple(prepared),
                deadline=deadline,
                return_embeddings=parsed.return_embeddings,
                traceparent=traceparent,
                videos=tuple(videos),
            )
        )
        timeout_s = deadline - time.monotonic() + _DEADLINE_GRACE_S
        return await unless_gone(request, work, timeout_s, self._late)

    def _late(self) -> VitserveError:
        return Timeout(f"no result within {self.config.request_timeout_s}s (--request_timeout_s)")

    def _response_body(
        self,
        parsed: ParsedRequest,
        prepared: list[PreparedImage],
        results: list[ImageResult],
        videos: list[PreparedVideo] | None = None,
    ) -> dict[str, Any]:
        videos = videos or []
        images = []
        for index, (p, r) in enumerate(zip(prepared, results[: len(prepared)], strict=True)):
            out = {
                "index": index,
                "image_id": p.image_id,
                "num_tokens": r.num_tokens,
                "grid_thw": list(p.item.grid_thw),
                "original_size": list(p.original_size),
                "resized_size": list(p.item.resized_size),
                "clamped": p.item.clamped,
                "cached": r.cached,
                "delivered": r.delivered,
            }
            if parsed.return_embeddings and r.embedding is not None:
                out["embedding"] = tensor_json(r.embedding)
                if r.deepstack:
                    out["deepstack"] = [tensor_json(t) for t in r.deepstack]
            images.append(out)

        def stage(name: str) -> float:  # queue/encode/send overlap across images: the request waited the max
            return round(max((getattr(r.timing, f"{name}_ms") for r in results), default=0.0), 3)

        decode_s = sum(p.decode_s for p in prepared) + sum(v.times()[0] for v in videos)
        preprocess_s = sum(p.preprocess_s for p in prepared) + sum(v.times()[1] for v in videos)
        timing = {
            "decode": round(decode_s * 1000, 3),
            "preprocess": round(preprocess_s * 1000, 3),
            "queue": stage("queue"),
            "encode": stage("encode"),
            "send": stage("send"),
        }
        body: dict[str, Any] = {
            "request_id": parsed.request_id,
            "model": self.engine.info().model,
            "images": images,
            "timing_ms": timing,
        }
        if videos:
            group_results = iter(results[len(prepared) :])
            body["videos"] = [
                video_body(index, video, [next(group_results) for _ in video.groups], tensor_json)
                for index, video in enumerate(videos)
            ]
        return body


class _StageClock:
    """Wall time of the request's stages inside the handler, into vitserve_stage_seconds{stage}: read (the
    body), parse (JSON/base64 or multipart), prepare (fetch, decode, preprocess: pool hops included),
    engine (enqueue -> results back in this request), respond (the response body), request (all of it).
    With one request at a time, the increase of a stage's _sum between two scrapes is that request's time
    (bench/latency.py reads them so)."""

    def __init__(self, metrics: Metrics):
        self._stage = metrics.stage_seconds
        self._start = self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self._stage.labels(stage=stage).observe(now - self._last)
        self._last = now

    def total(self, stage: str) -> None:
        self._stage.labels(stage=stage).observe(time.perf_counter() - self._start)


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


def count_accepted(metrics: Metrics, prepared: list[PreparedImage]) -> None:
    """Token and clamp metrics of images that passed preprocessing, whichever route they came by."""
    for p in prepared:
        metrics.image_tokens.observe(p.item.num_tokens)
        if p.item.clamped:
            metrics.images_clamped_total.inc()
