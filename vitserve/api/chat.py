"""POST /v1/chat/completions in front of an OpenAI-compatible LLM server (--llm_url; docs/vllm.md).

read -> parse -> find the image and video parts -> fetch + decode + preprocess ALL (videos as /encode does
them, api/videos.py) -> engine (one request, every image and video group together: queue, budget, cache,
dedup) -> replace each part by the LLM's embedding part, checked -> forward -> relay the answer (server-sent
events as they arrive, unchanged).

All-or-nothing as /encode: a bad image or video anywhere means nothing is encoded and nothing reaches the LLM
server. vitserve's own errors come in OpenAI's shape (errors.openai_error) with /encode's codes; the LLM
server's statuses and bodies pass through unchanged.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from vitserve.api.body import ClientGone, read_body
from vitserve.api.chat_parts import ChatParts, MediaPart, media_parts
from vitserve.api.inputs import VideoSource, check_count
from vitserve.api.media import INLINE_BODY_BYTES, Encoded, Media, MediaPipeline, unless_gone
from vitserve.api.tracing import Tracing
from vitserve.config import Config
from vitserve.contract import ItemResult, RequestItem
from vitserve.errors import InvalidRequest, LLMTimeout, VitserveError, openai_error
from vitserve.handover.base import NO_MEDIA, Handover, Transport
from vitserve.handover.upstream import Upstream, relayed_headers

log = logging.getLogger(__name__)
CHAT_ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"
# The request headers that go upstream besides content type, authorization and traceparent.
_FORWARDED = ("accept", "x-request-id", "tracestate")


class ChatHandler:
    def __init__(
        self,
        config: Config,
        media: MediaPipeline,
        tracing: Tracing,
        upstream: Upstream,
        transport: Transport,
    ):
        self.config = config
        self.media = media
        self.pre = media.pre
        self.metrics = media.metrics
        self.tracing = tracing
        self.upstream = upstream
        self.transport = transport  # --llm_transport's (handover/transports.py), picked once by the app
        self.layout = transport.layout

    async def __call__(self, request: Request) -> Response:
        trace = self.tracing.start(request.headers.get("traceparent"))
        deadline = time.monotonic() + self.config.request_timeout_s
        parts: ChatParts | None = None  # once the body is parsed: an error's index names its part
        try:
            body, payload, parts = await self._read(request)
            response = await self._handle(request, body, payload, parts, deadline, trace.traceparent)
        except VitserveError as err:
            response = _error_response(err, parts)
        except ClientGone:
            response = Response(status_code=499)
        except Exception as exc:  # the handler's own bug: a 500 in the shape the client parses
            log.exception("chat completion failed: %r", exc)
            response = _error_response(VitserveError("internal error; see the server log"), None)
        trace.finish(response.status_code)
        response.headers["traceparent"] = trace.traceparent
        return response

    async def _read(self, request: Request) -> tuple[bytes, Any, ChatParts]:
        """The body as it came, parsed, and its image and video parts."""
        body = await read_body(request, self.config.max_request_bytes)
        payload = await self._parsed(body)
        return body, payload, media_parts(payload)

    async def _handle(
        self, request: Request, body: bytes, payload: Any, parts: ChatParts, deadline: float, traceparent: str
    ) -> Response:
        """The parts rewritten by the transport's hand-over, then the request forwarded."""
        handover = self.transport.begin() if parts else NO_MEDIA  # without media: the body as it came
        streaming = False
        try:
            if parts:
                self._check_videos_served(parts)
                check_count(len(parts.images), self.config, len(parts.videos))
                encoded = await self._encode(request, parts, deadline, traceparent, handover)
                if encoded is None:
                    log.info("chat request: client disconnected while its images queued; withdrawn")
                    return Response(status_code=499)
                start = time.perf_counter()  # the engine's results are here: until the body is ready to go
                await self.pre.run(self._rewrite, parts, encoded, handover)
                body = await handover.ready(payload)  # the transport's checks just before, then its body
                self.metrics.stage_seconds.labels(stage="handover").observe(time.perf_counter() - start)
            stream = payload.get("stream") is True
            response = await self._forward(request, body, stream, traceparent, handover)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:  # a stream releases what it holds once relayed
                handover.release()

    async def _parsed(self, body: bytes) -> Any:
        if len(body) <= INLINE_BODY_BYTES:
            return _loads(body)
        return await self.pre.run(_loads, body)

    def _check_videos_served(self, parts: ChatParts) -> None:
        """A request with a video this server cannot hand the LLM is refused before anything is decoded (the
        error names the first video part)."""
        if not parts.videos:
            return
        try:
            self.media.check_videos_served(len(parts.videos))
            self.layout.check_video_served()
        except VitserveError as err:
            raise err.with_video_index(0) from None

    async def _encode(
        self,
        request: Request,
        parts: ChatParts,
        deadline: float,
        traceparent: str,
        handover: Handover,
    ) -> Encoded | None:
        """Every image and video of the request, prepared together and handed to the engine as one request;
        an image the hand-over says the LLM side holds is an item handed over already (its part is the
        hand-over's)."""
        media = Media(
            f"chat-{uuid.uuid4()}",
            [p.source for p in parts.images],
            [p.source for p in parts.videos if isinstance(p.source, VideoSource)],
            return_embeddings=True,
            traceparent=traceparent,
            held=handover.held if handover.reuses else None,
            check_video=self.layout.check_video_time,  # a video's time vLLM would misplace: before any encoding
        )
        work = await self.media.prepare(media, deadline)
        return await self.media.encode(request, work)

    @staticmethod
    def _rewrite(parts: ChatParts, encoded: Encoded, handover: Handover) -> None:
        """Each image_url and video_url part becomes the hand-over's embedding part, in place, walking the
        request's items (on the pool: e.g. the inline tensor, or a file written). An image handed over
        already gets the part the hand-over kept for it."""
        groups: list[list[ItemResult]] = [[] for _ in parts.videos]
        for item, result in encoded.walk():
            if item.group is None:
                _replace(parts.images[item.media_index], _image_part(handover, item, result))
            else:
                assert result is not None, "a video's groups are never handed over before the engine"
                groups[item.media_index].append(result)
        for index, (part, video, results) in enumerate(
            zip(parts.videos, encoded.request.videos, groups, strict=True)
        ):
            try:
                new = handover.video_part(video, results, index)
            except VitserveError as err:
                raise err.with_video_index(index) from None
            _replace(part, new)

    async def _forward(
        self, request: Request, body: bytes, stream: bool, traceparent: str, handover: Handover
    ) -> Response:
        """Send the request on; the hand-over reads the answer (ec_storage: a non-consumer's refusal becomes
        vitserve's 502), and a stream releases what the hand-over holds once it ends."""
        self.metrics.upstream_body_bytes.observe(len(body))
        deadline = time.monotonic() + self.config.llm_timeout_s
        extra = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        extra.update({"content-type": "application/json", "traceparent": traceparent})
        extra.update(handover.upstream_headers())
        headers = self.upstream.headers(self._client_auth(request), extra)
        upstream_request = self.upstream.client.build_request(
            "POST", CHAT_ROUTE, content=body, headers=headers
        )
        if not stream:
            return await self._complete(request, upstream_request, deadline, handover)
        response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
        if response.status_code != 200:  # an error before the stream began: its body, as it came
            content = await self.upstream.read(response, deadline)
            handover.check_answer(response.status_code, content)
            return Response(content, response.status_code, relayed_headers(response.headers))
        return StreamingResponse(
            self._relay(response, deadline, handover),
            status_code=200,
            headers=relayed_headers(response.headers),
            background=BackgroundTask(handover.release),
        )

    async def _complete(
        self, request: Request, upstream_request: httpx.Request, deadline: float, handover: Handover
    ) -> Response:
        """One non-streamed completion, abandoned (the LLM server aborts it) if the client leaves first."""

        async def call() -> Response:
            response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
            content = await self.upstream.read(response, deadline)
            handover.check_answer(response.status_code, content)
            return Response(content, response.status_code, relayed_headers(response.headers))

        late = lambda: LLMTimeout(  # noqa: E731
            f"the LLM server did not answer within {self.config.llm_timeout_s:g}s (--llm_timeout_s)"
        )
        answer = await unless_gone(request, call(), deadline - time.monotonic() + 1.0, late)
        return answer if answer is not None else Response(status_code=499)

    async def _relay(
        self, response: httpx.Response, deadline: float, handover: Handover
    ) -> AsyncIterator[bytes]:
        """The event stream unchanged. A failure after the 200 went out can only be told in the stream: one
        `data: {"error": ...}` event, as vLLM itself reports errors mid-stream, then the end."""
        try:
            async for chunk in self.upstream.chunks(response, deadline):
                yield chunk
        except VitserveError as err:
            log.warning("chat stream from the LLM server ended early: %s", err.message)
            yield b"data: " + openai_error(err)[2] + b"\n\n"
        finally:
            handover.release()

    def _client_auth(self, request: Request) -> str | None:
        """The client's Authorization goes upstream only when vitserve does not use it itself (--api_key)."""
        return None if self.config.api_key else request.headers.get("authorization")

    async def models(self, request: Request) -> Response:
        """GET /v1/models, passed through."""
        deadline = time.monotonic() + self.config.llm_timeout_s
        headers = self.upstream.headers(self._client_auth(request), {})
        try:
            response = await self.upstream.send(
                MODELS_ROUTE,
                self.upstream.client.build_request("GET", MODELS_ROUTE, headers=headers),
                deadline,
            )
            content = await self.upstream.read(response, deadline)
        except VitserveError as err:
            return _error_response(err, None)
        return Response(content, response.status_code, relayed_headers(response.headers))


def _loads(body: bytes) -> Any:
    if not body:
        raise InvalidRequest("empty request body")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("malformed JSON body") from None


def _image_part(handover: Handover, item: RequestItem, result: ItemResult | None) -> dict[str, Any]:
    """The part for an image item, checked; an error names the image by its index."""
    index = item.media_index
    if item.prepared is None or result is None:  # handed over already: the hand-over kept its part
        kept = handover.reused_part(index)
        assert kept is not None, "an image is handed over before the engine only by the hand-over"
        return kept
    try:
        return handover.image_part(item.prepared, result, index)
    except VitserveError as err:
        raise err.with_index(index) from None


def _replace(part: MediaPart, new: dict[str, Any]) -> None:
    part.part.clear()
    part.part.update(new)


def _error_response(err: VitserveError, parts: ChatParts | None) -> Response:
    """The error in OpenAI's shape; `param` is the JSON path of the part the error names by its image or
    video index (the one mapping from an index to a part)."""
    if err.status >= 500:
        log.warning("%s: %s", err.code, err.message)
    status, headers, body = openai_error(err, _param(err, parts))
    return Response(body, status_code=status, headers=headers)


def _param(err: VitserveError, parts: ChatParts | None) -> str | None:
    if parts is None:  # the body was not parsed: no part to name
        return None
    if err.image_index is not None and err.image_index < len(parts.images):
        return parts.images[err.image_index].param
    if err.video_index is not None and err.video_index < len(parts.videos):
        return parts.videos[err.video_index].param
    return None
