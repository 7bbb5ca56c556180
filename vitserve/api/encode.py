"""POST /encode: read -> parse -> fetch -> decode+preprocess ALL -> engine -> respond (docs/api.md).

All-or-nothing: every image and video is validated, decoded and preprocessed before anything is enqueued,
so a bad image or video anywhere in the request means nothing is encoded and nothing reaches the LLM.
Videos go through api/videos.py; their temporal groups come back from the engine after the images, and
are joined here into one embedding per video (docs/video.md).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any, TypeVar

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vitserve.api.body import ClientGone, read_body
from vitserve.api.inputs import (
    ParsedRequest,
    media_type,
    parse_json_body,
    parse_multipart_body,
)
from vitserve.api.media import INLINE_BODY_BYTES, Encoded, Media, MediaPipeline
from vitserve.api.tracing import RequestTrace, Tracing
from vitserve.api.videos import video_body
from vitserve.config import Config
from vitserve.errors import InvalidRequest, Timeout, VitserveError
from vitserve.metrics import Metrics
from vitserve.rpc.tensors import dtype_name, tensor_to_buffer

log = logging.getLogger(__name__)
T = TypeVar("T")


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return {
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "b64": base64.b64encode(tensor_to_buffer(t)).decode(),
    }


class EncodeHandler:
    def __init__(self, config: Config, media: MediaPipeline, tracing: Tracing):
        self.config = config
        self.media = media
        self.metrics = media.metrics
        self.tracing = tracing

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
        try:
            parsed = await self._parse_within(request, deadline, clock)
            media = Media(
                parsed.request_id, parsed.sources, parsed.videos, parsed.return_embeddings, trace.traceparent
            )
            trace.mark("decode")
            work = await self.media.prepare(media, deadline)
            clock.lap("prepare")
            trace.mark("engine")
            encoded = await self.media.encode(request, work)
            clock.lap("engine")
        except ClientGone:
            return Response(status_code=499)
        if encoded is None:
            log.info(
                "request %s: client disconnected while queued; its images were withdrawn", parsed.request_id
            )
            return Response(status_code=499)
        images, _ = encoded.encoded()
        trace.record(parsed.request_id, [p for p, _ in images], [r for _, r in images])
        if parsed.return_embeddings:  # base64 of every embedding: CPU work for the pool
            body = await self.media.pre.run(self._response_body, encoded)
        else:
            body = self._response_body(encoded)
        response = JSONResponse(body)
        clock.lap("respond")
        clock.total("request")
        return response

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
            parsed = await self.media.pre.run(parse_multipart_body, request.headers, body, self.config)
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
            parsed = await self.media.pre.run(parse_json_body, body, self.config)
        clock.lap("parse")
        return parsed

    def _response_body(self, encoded: Encoded) -> dict[str, Any]:
        request = encoded.request
        image_results, video_results = encoded.encoded()
        images = []
        for index, (p, r) in enumerate(image_results):
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
            if request.return_embeddings and r.embedding is not None:
                out["embedding"] = tensor_json(r.embedding)
                if r.deepstack:
                    out["deepstack"] = [tensor_json(t) for t in r.deepstack]
            images.append(out)

        results = [r for _, r in image_results] + [r for group in video_results for r in group]

        def stage(name: str) -> float:  # queue/encode/send overlap across items: the request waited the max
            return round(max((getattr(r.timing, f"{name}_ms") for r in results), default=0.0), 3)

        decode_s = sum(p.decode_s for p, _ in image_results) + sum(v.times()[0] for v in request.videos)
        preprocess_s = sum(p.preprocess_s for p, _ in image_results) + sum(
            v.times()[1] for v in request.videos
        )
        timing = {
            "decode": round(decode_s * 1000, 3),
            "preprocess": round(preprocess_s * 1000, 3),
            "queue": stage("queue"),
            "encode": stage("encode"),
            "send": stage("send"),
        }
        body: dict[str, Any] = {
            "request_id": request.request_id,
            "model": self.media.engine.info().model,
            "images": images,
            "timing_ms": timing,
        }
        if request.videos:
            body["videos"] = [
                video_body(index, video, results, tensor_json)
                for index, (video, results) in enumerate(zip(request.videos, video_results, strict=True))
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
