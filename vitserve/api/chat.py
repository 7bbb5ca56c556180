"""POST /v1/chat/completions in front of an OpenAI-compatible LLM server (--llm_url; docs/vllm.md).

read -> parse -> find the image parts -> fetch + decode + preprocess ALL -> engine (one request, every
image together: queue, budget, cache, dedup) -> replace each part by the LLM's embedding part, checked ->
forward -> relay the answer (server-sent events as they arrive, unchanged).

All-or-nothing as /encode: a bad image anywhere means nothing is encoded and nothing reaches the LLM
server. vitserve's own errors come in OpenAI's shape (errors.openai_error) with /encode's codes; the LLM
server's statuses and bodies pass through unchanged.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from vitserve.api.body import ClientGone, read_body
from vitserve.api.embeds import EmbedsLayout, embeds_part
from vitserve.api.encode import INLINE_BODY_BYTES, count_accepted, unless_gone
from vitserve.api.inputs import ImageSource, check_count, decode_b64, fetch_sources
from vitserve.api.pipeline import Preprocessor
from vitserve.api.tracing import Tracing
from vitserve.api.upstream import Upstream, relayed_headers
from vitserve.config import Config
from vitserve.contract import EncodeRequest, Engine, ImageResult, PreparedImage
from vitserve.errors import InvalidRequest, LLMTimeout, Timeout, VitserveError, openai_error
from vitserve.metrics import Metrics

log = logging.getLogger(__name__)
CHAT_ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"
# Parts the client may not send: an embedding from outside would reach the LLM server unchecked, and some
# malformed ones kill its engine (docs/vllm.md). vitserve makes them from images.
_EMBEDS_PARTS = frozenset({"image_embeds", "video_embeds"})
# The request headers that go upstream besides content type, authorization and traceparent.
_FORWARDED = ("accept", "x-request-id", "tracestate")


@dataclass
class ImagePart:
    """One `image_url` content part of the request: where it is, and the dict that will be rewritten."""

    param: str  # its JSON path, e.g. messages[1].content[0], for OpenAI's `param`
    part: dict[str, Any]
    source: ImageSource


def image_parts(payload: Any) -> list[ImagePart]:
    """Every image_url part, in message order; InvalidRequest (with its path) for a malformed one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        raise InvalidRequest(
            "the body must be a JSON object with a 'messages' list (OpenAI chat completions)"
        )
    found = []
    for i, message in enumerate(payload["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue  # a string or no content: nothing to encode
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            param = f"messages[{i}].content[{j}]"
            if kind in _EMBEDS_PARTS:
                raise InvalidRequest(
                    f"{param}: {kind} parts are not accepted; send the image itself (image_url) and "
                    "vitserve encodes it"
                )
            if kind == "image_url":
                found.append(ImagePart(param, part, _source(part, param)))
    return found


def _source(part: dict[str, Any], param: str) -> ImageSource:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{param}.image_url must be an object with a 'url' (a data: URL or http(s) URL)")
    if url.startswith("data:"):
        return ImageSource(data=_data_url_bytes(url, param))
    return ImageSource(url=url)


def _data_url_bytes(url: str, param: str) -> bytes:
    head, sep, _ = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequest(f"{param}.image_url.url: a data: URL must be base64 (data:image/...;base64,...)")
    try:
        return decode_b64(url, 0)
    except InvalidRequest:
        raise InvalidRequest(f"{param}.image_url.url is not valid base64") from None


class ChatHandler:
    def __init__(
        self,
        config: Config,
        engine: Engine,
        preprocessor: Preprocessor,
        metrics: Metrics,
        tracing: Tracing,
        upstream: Upstream,
        layout: EmbedsLayout,
    ):
        self.config = config
        self.engine = engine
        self.pre = preprocessor
        self.metrics = metrics
        self.tracing = tracing
        self.upstream = upstream
        self.layout = layout

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
        parts = image_parts(payload)
        if parts:
            check_count(len(parts), self.config)
            results, prepared = await self._encode(request, parts, deadline, traceparent, param)
            if results is None:
                log.info("chat request: client disconnected while its images queued; withdrawn")
                return Response(status_code=499)
            await self.pre.run(self._rewrite, parts, prepared, results, param)
            body = await self.pre.run(_dumps, payload)
        return await self._forward(request, body, payload.get("stream") is True, traceparent)

    async def _parsed(self, body: bytes) -> Any:
        if len(body) <= INLINE_BODY_BYTES:
            return _loads(body)
        return await self.pre.run(_loads, body)

    async def _encode(
        self,
        request: Request,
        parts: list[ImagePart],
        deadline: float,
        traceparent: str,
        param: list[str | None],
    ) -> tuple[list[ImageResult] | None, list[PreparedImage]]:
        """Every image of the request, prepared together and handed to the engine as one request."""
        try:
            self.engine.admit(None)  # a full queue refuses before any decoding is spent
            blobs = await fetch_sources([p.source for p in parts], self.config, deadline)
            prepared = await self.pre.prepare(blobs, deadline)
            count_accepted(self.metrics, prepared)
        except VitserveError as err:
            if err.image_index is not None:
                param[0] = parts[err.image_index].param
            self.metrics.images_total.labels(outcome="rejected").inc(len(parts))
            raise
        encode = EncodeRequest(
            request_id=f"chat-{uuid.uuid4()}",
            images=tuple(prepared),
            deadline=deadline,
            return_embeddings=True,
            traceparent=traceparent,
        )
        late = lambda: Timeout(f"no result within {self.config.request_timeout_s}s (--request_timeout_s)")  # noqa: E731
        timeout_s = deadline - time.monotonic() + 5.0  # the engine enforces the deadline; this is a backstop
        return await unless_gone(request, self.engine.encode(encode), timeout_s, late), prepared

    def _rewrite(
        self,
        parts: list[ImagePart],
        prepared: list[PreparedImage],
        results: list[ImageResult],
        param: list[str | None],
    ) -> None:
        """Each image_url part becomes the LLM's embedding part, in place (CPU: .npy + base64, on the pool)."""
        for index, (part, image, result) in enumerate(zip(parts, prepared, results, strict=True)):
            param[0] = part.param
            new = embeds_part(self.layout, image, result, index)
            part.part.clear()
            part.part.update(new)
        param[0] = None

    async def _forward(self, request: Request, body: bytes, stream: bool, traceparent: str) -> Response:
        deadline = time.monotonic() + self.config.llm_timeout_s
        extra = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        extra.update({"content-type": "application/json", "traceparent": traceparent})
        headers = self.upstream.headers(self._client_auth(request), extra)
        upstream_request = self.upstream.client.build_request(
            "POST", CHAT_ROUTE, content=body, headers=headers
        )
        if not stream:
            return await self._complete(request, upstream_request, deadline)
        response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
        if response.status_code != 200:  # an error before the stream began: its body, as it came
            content = await self.upstream.read(response, deadline)
            return Response(content, response.status_code, relayed_headers(response.headers))
        return StreamingResponse(
            self._relay(response, deadline),
            status_code=200,
            headers=relayed_headers(response.headers),
        )

    async def _complete(self, request: Request, upstream_request: httpx.Request, deadline: float) -> Response:
        """One non-streamed completion, abandoned (the LLM server aborts it) if the client leaves first."""

        async def call() -> Response:
            response = await self.upstream.send(CHAT_ROUTE, upstream_request, deadline)
            content = await self.upstream.read(response, deadline)
            return Response(content, response.status_code, relayed_headers(response.headers))

        late = lambda: LLMTimeout(  # noqa: E731
            f"the LLM server did not answer within {self.config.llm_timeout_s:g}s (--llm_timeout_s)"
        )
        answer = await unless_gone(request, call(), deadline - time.monotonic() + 1.0, late)
        return answer if answer is not None else Response(status_code=499)

    async def _relay(self, response: httpx.Response, deadline: float) -> AsyncIterator[bytes]:
        """The event stream unchanged. A failure after the 200 went out can only be told in the stream: one
        `data: {"error": ...}` event, as vLLM itself reports errors mid-stream, then the end."""
        try:
            async for chunk in self.upstream.chunks(response, deadline):
                yield chunk
        except VitserveError as err:
            log.warning("chat stream from the LLM server ended early: %s", err.message)
            yield b"data: " + openai_error(err)[2] + b"\n\n"

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


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def _error_response(err: VitserveError, param: str | None) -> Response:
    if err.status >= 500:
        log.warning("%s: %s", err.code, err.message)
    status, headers, body = openai_error(err, param)
    return Response(body, status_code=status, headers=headers)
