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
from vitserve.api.chat_parts import ChatParts, media_parts
from vitserve.api.inputs import VideoSource, check_count
from vitserve.api.media import INLINE_BODY_BYTES, Encoded, Media, MediaPipeline, unless_gone
from vitserve.api.tracing import Tracing
from vitserve.config import Config
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
        param: list[str | None] = [None]  # the part at fault, once known
        try:
            response = await self._handle(request, trace.traceparent, param)
        except VitserveError as err:
            response = _error_response(err, param[0])
        except ClientGone:
            response = Response(status_code=499)
        except Exception as exc:  # the handler's own bug: a 500 in the shape the client parses
            log.exception("chat completion failed: %r", exc)
            response = _error_response(VitserveError("internal error; see the server log"), None)
        trace.finish(response.status_code)
        response.headers["traceparent"] = trace.traceparent
        return response

    async def _handle(self, request: Request, traceparent: str, param: list[str | None]) -> Response:
        deadline = time.monotonic() + self.config.request_timeout_s
        body = await read_body(request, self.config.max_request_bytes)
        payload = await self._parsed(body)
        parts = media_parts(payload)
        handover = self.transport.begin() if parts else NO_MEDIA  # without media: the body as it came
        streaming = False
        try:
            if parts:
                self._check_videos_served(parts, param)
                check_count(len(parts.images), self.config, len(parts.videos))
                encoded = await self._encode(request, parts, deadline, traceparent, param, handover)
                if encoded is None:
                    log.info("chat request: client disconnected while its images queued; withdrawn")
                    return Response(status_code=499)
                start = time.perf_counter()  # the engine's results are here: until the body is ready to go
                await self.pre.run(self._rewrite, parts, encoded, param, handover)
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

    def _check_videos_served(self, parts: ChatParts, param: list[str | None]) -> None:
        """A request with a video this server cannot hand the LLM is refused before anything is decoded."""
        if not parts.videos:
            return
        param[0] = parts.videos[0].param
        self.media.check_videos_served(len(parts.videos))
        self.layout.check_video_served()
        param[0] = None

    async def _encode(
        self,
        request: Request,
        parts: ChatParts,
        deadline: float,
        traceparent: str,
        param: list[str | None],
        handover: Handover,
    ) -> Encoded | None:
        """Every image and video of the request, prepared together and handed to the engine as one request;
        an image the hand-over says the LLM side holds is left out (its part is the hand-over's)."""
        media = Media(
            f"chat-{uuid.uuid4()}",
            [p.source for p in parts.images],
            [p.source for p in parts.videos if isinstance(p.source, VideoSource)],
            return_embeddings=True,
            traceparent=traceparent,
        )
        try:  # a video's time vLLM would misplace is refused before any encoding
            work = await self.media.prepare(media, deadline, self.layout.check_video_time, handover)
        except VitserveError as err:
            if err.image_index is not None:
                param[0] = parts.images[err.image_index].param
            elif err.video_index is not None:
                param[0] = parts.videos[err.video_index].param
            raise
        return await self.media.encode(request, work)

    @staticmethod
    def _rewrite(parts: ChatParts, encoded: Encoded, param: list[str | None], handover: Handover) -> None:
        """Each image_url and video_url part becomes the hand-over's embedding part, in place (on the pool:
        e.g. the inline tensor, or a file written). An image the hand-over already has a part for was not
        encoded."""
        image_results, video_results = encoded.split()
        fresh = iter(zip(encoded.images, image_results, strict=True))
        for index, part in enumerate(parts.images):
            param[0] = part.param
            new = handover.reused_part(index)
            if new is None:
                image, result = next(fresh)
                new = handover.image_part(image, result, index)
            part.part.clear()
            part.part.update(new)
        for index, (part, video, results) in enumerate(
            zip(parts.videos, encoded.videos, video_results, strict=True)
        ):
            param[0] = part.param
            new = handover.video_part(video, results, index)
            part.part.clear()
            part.part.update(new)
        param[0] = None

    async def _forward(
        self, request: Request, body: bytes, stream: bool, traceparent: str, handover: Handover
    ) -> Response:
        """Send the request on; the hand-over reads the answer (ec_storage: a non-consumer's refusal becomes
        vitserve's 502), and a stream releases what the hand-over holds once it ends."""
        self.metrics.upstream_body_bytes.observe(len(body))
        deadline = time.monotonic() + self.config.llm_timeout_s
        extra = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        extra.update({"content-type": "application/json", "traceparent": traceparent})
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


def _error_response(err: VitserveError, param: str | None) -> Response:
    if err.status >= 500:
        log.warning("%s: %s", err.code, err.message)
    status, headers, body = openai_error(err, param)
    return Response(body, status_code=status, headers=headers)
