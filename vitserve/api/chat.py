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

import functools
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
from vitserve.contract import ImageResult, PreparedImage
from vitserve.errors import InvalidRequest, LLMTimeout, VitserveError, openai_error
from vitserve.handover.ec_storage import EcHandover, EcTicket
from vitserve.handover.embeds import EmbedsLayout, embeds_part, video_embeds_part
from vitserve.handover.inline import dumps_body
from vitserve.handover.upstream import Upstream, relayed_headers
from vitserve.handover.wire import WireHandover, WireTicket

log = logging.getLogger(__name__)
CHAT_ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"
# The request headers that go upstream besides content type, authorization and traceparent.
_FORWARDED = ("accept", "x-request-id", "tracestate")
Ticket = EcTicket | WireTicket  # one request's hand-over state (ec_storage's files, wire's messages)


class ChatHandler:
    def __init__(
        self,
        config: Config,
        media: MediaPipeline,
        tracing: Tracing,
        upstream: Upstream,
        layout: EmbedsLayout,
        ec: EcHandover | WireHandover | None = None,
    ):
        self.config = config
        self.media = media
        self.pre = media.pre
        self.metrics = media.metrics
        self.tracing = tracing
        self.upstream = upstream
        self.layout = layout
        # --llm_transport ec_storage (handover/ec_storage.py) or wire (handover/wire.py); None: inline. Typed Any
        # until the transports share one interface: each takes its own ticket, which the union cannot say
        self.ec: Any = ec

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
        ticket = self.ec.ticket() if self.ec is not None and parts else None
        streaming = False
        try:
            if parts:
                self._check_videos_served(parts, param)
                check_count(len(parts.images), self.config, len(parts.videos))
                encoded = await self._encode(request, parts, deadline, traceparent, param, ticket)
                if encoded is None:
                    log.info("chat request: client disconnected while its images queued; withdrawn")
                    return Response(status_code=499)
                handover = time.perf_counter()  # the engine's results are here: until the body is ready to go
                await self.pre.run(self._rewrite, parts, encoded, param, ticket)
                if ticket is not None and self.ec is not None:
                    await self._hand_over(payload, ticket, deadline, traceparent)
                body = await self.pre.run(dumps_body, payload)  # inline: the embeddings' base64 spliced in
                self.metrics.stage_seconds.labels(stage="handover").observe(time.perf_counter() - handover)
            response = await self._forward(request, body, payload.get("stream") is True, traceparent, ticket)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if ticket is not None and not streaming:  # a stream releases its files once relayed
                ticket.release()

    async def _hand_over(self, payload: Any, ticket: Ticket, deadline: float, traceparent: str) -> None:
        """Just before the request goes upstream: ec_storage checks every file it names, wire pushes every
        embedding and waits for the connector's acknowledgements; nothing goes upstream if one fails."""
        assert self.ec is not None
        self.ec.strip(payload)
        if isinstance(self.ec, WireHandover) and isinstance(ticket, WireTicket):
            await self.ec.deliver(ticket, deadline, traceparent)
        elif isinstance(self.ec, EcHandover) and isinstance(ticket, EcTicket):
            await self.pre.run(self.ec.check, ticket)

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
        ticket: Ticket | None,
    ) -> Encoded | None:
        """Every image and video of the request, prepared together and handed to the engine as one request;
        with ec_storage, an image whose file is still there is left out (its part is in the ticket)."""
        media = Media(
            f"chat-{uuid.uuid4()}",
            [p.source for p in parts.images],
            [p.source for p in parts.videos if isinstance(p.source, VideoSource)],
            return_embeddings=True,
            traceparent=traceparent,
        )
        try:  # a video's time vLLM would misplace is refused before any encoding
            reuse = functools.partial(self.ec.image_hits, ticket) if self.ec and ticket else None
            work = await self.media.prepare(media, deadline, self.layout.check_video_time, reuse)
        except VitserveError as err:
            if err.image_index is not None:
                param[0] = parts.images[err.image_index].param
            elif err.video_index is not None:
                param[0] = parts.videos[err.video_index].param
            raise
        return await self.media.encode(request, work)

    def _rewrite(
        self, parts: ChatParts, encoded: Encoded, param: list[str | None], ticket: Ticket | None
    ) -> None:
        """Each image_url and video_url part becomes the LLM's embedding part, in place (on the pool: the
        inline tensor, whose base64 dumps_body makes, or a file with ec_storage). An image the ticket
        already has a part for was not encoded."""
        image_results, video_results = encoded.split()
        done = ticket.hits if ticket is not None else [None] * len(parts.images)
        fresh = iter(zip(encoded.images, image_results, strict=True))
        for index, (part, new) in enumerate(zip(parts.images, done, strict=True)):
            param[0] = part.param
            if new is None:
                image, result = next(fresh)
                new = self._image_part(image, result, index, ticket)
            part.part.clear()
            part.part.update(new)
        for index, (part, video, results) in enumerate(
            zip(parts.videos, encoded.videos, video_results, strict=True)
        ):
            param[0] = part.param
            if ticket is not None and self.ec is not None:
                new = self.ec.video_part(ticket, video, results, index)
            else:
                new = video_embeds_part(self.layout, video, results, index)
            part.part.clear()
            part.part.update(new)
        param[0] = None

    def _image_part(
        self, image: PreparedImage, result: ImageResult, index: int, ticket: Ticket | None
    ) -> dict[str, Any]:
        if ticket is not None and self.ec is not None:
            part: dict[str, Any] = self.ec.image_part(ticket, image, result, index)
            return part
        return embeds_part(self.layout, image, result, index)

    async def _forward(
        self, request: Request, body: bytes, stream: bool, traceparent: str, ticket: Ticket | None
    ) -> Response:
        """Send the request on; with ec_storage (a ticket), a non-consumer's refusal becomes vitserve's 502
        and a stream releases the request's files once it ends."""
        self.metrics.upstream_body_bytes.observe(len(body))
        deadline = time.monotonic() + self.config.llm_timeout_s
        extra = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        extra.update({"content-type": "application/json", "traceparent": traceparent})
        headers = self.upstream.headers(self._client_auth(request), extra)
        upstream_request = self.upstream.client.build_request(
            "POST", CHAT_ROUTE, content=body, headers=headers
        )
        if not stream:
            return await self._complete(request, upstream_request, deadline, ticket)
        response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
        if response.status_code != 200:  # an error before the stream began: its body, as it came
            content = await self.upstream.read(response, deadline)
            if ticket is not None and self.ec is not None:
                self.ec.check_answer(response.status_code, content)
            return Response(content, response.status_code, relayed_headers(response.headers))
        return StreamingResponse(
            self._relay(response, deadline, ticket),
            status_code=200,
            headers=relayed_headers(response.headers),
            background=BackgroundTask(ticket.release) if ticket is not None else None,
        )

    async def _complete(
        self, request: Request, upstream_request: httpx.Request, deadline: float, ticket: Ticket | None
    ) -> Response:
        """One non-streamed completion, abandoned (the LLM server aborts it) if the client leaves first."""

        async def call() -> Response:
            response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
            content = await self.upstream.read(response, deadline)
            if ticket is not None and self.ec is not None:
                self.ec.check_answer(response.status_code, content)
            return Response(content, response.status_code, relayed_headers(response.headers))

        late = lambda: LLMTimeout(  # noqa: E731
            f"the LLM server did not answer within {self.config.llm_timeout_s:g}s (--llm_timeout_s)"
        )
        answer = await unless_gone(request, call(), deadline - time.monotonic() + 1.0, late)
        return answer if answer is not None else Response(status_code=499)

    async def _relay(
        self, response: httpx.Response, deadline: float, ticket: Ticket | None
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
            if ticket is not None:
                ticket.release()

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
