"""The LLM server behind the front door (--llm_url): one pooled async HTTP client, its deadline, its errors.

httpx's AsyncClient keeps connections alive across requests (a chat completion is one POST; reconnecting
for each would add a TCP handshake to every request). Environment proxies are ignored: the LLM server is a
sidecar on a known address. Failures become typed errors: a server that cannot be reached or drops the
connection is 502 `llm_unavailable`, one that does not answer within --llm_timeout_s is 504 `llm_timeout`.
Statuses and bodies the server does answer with are passed through unchanged by the caller.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

import httpx

from vitserve.config import redacted_url
from vitserve.errors import LLMTimeout, LLMUnavailable, VitserveError
from vitserve.metrics import Metrics

T = TypeVar("T")
# Response headers that describe one hop, not the content: never relayed.
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}
)


def api_base(url: str) -> str:
    """The base every route is under: the URL as given, with a trailing /v1 (an OpenAI client's base_url) or
    slash removed, so both spellings mean the same server."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def relayed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream response's headers a client should see (content type, request ids, ...)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


class Upstream:
    """Calls to the LLM server; each is counted in vitserve_upstream_requests_total{route, code} and timed in
    vitserve_upstream_seconds{phase="first_byte"|"total"}."""

    def __init__(self, url: str, *, api_key: str | None, timeout_s: float, metrics: Metrics):
        self.where = redacted_url(url)
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.api_key = api_key
        self.client = httpx.AsyncClient(
            base_url=api_base(url),
            # one deadline for the whole completion is enforced by the caller (deadline below); these bound
            # each step so that a silent server cannot hold a connection past it either
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )

    def headers(self, client_auth: str | None, extra: Mapping[str, str]) -> dict[str, str]:
        """--llm_api_key when set; otherwise the client's own Authorization, passed through (docs/vllm.md)."""
        out = {"accept-encoding": "identity", **extra}  # raw bytes relayed as they come: no re-encoding
        auth = f"Bearer {self.api_key}" if self.api_key else client_auth
        if auth:
            out["authorization"] = auth
        return out

    async def send(self, route: str, request: httpx.Request, deadline: float) -> httpx.Response:
        """The response with its headers read and its body still streaming; the caller closes it."""
        start = time.perf_counter()
        try:
            response = await self._within(self.client.send(request, stream=True), deadline)
        except VitserveError as err:
            self.metrics.upstream_requests_total.labels(route=route, code=err.code).inc()
            raise
        self.metrics.upstream_seconds.labels(phase="first_byte").observe(time.perf_counter() - start)
        self.metrics.upstream_requests_total.labels(route=route, code=str(response.status_code)).inc()
        return response

    async def read(self, response: httpx.Response, deadline: float) -> bytes:
        """The whole body (a non-streamed answer); the response is closed."""
        try:
            return await self._within(response.aread(), deadline)
        finally:
            await self._close(response)

    async def chunks(self, response: httpx.Response, deadline: float) -> AsyncIterator[bytes]:
        """The body as it arrives, unchanged; the response is closed however the caller stops reading (a
        client that disconnects closes the upstream connection, and vLLM aborts the request)."""
        raw = response.aiter_raw()
        try:
            while True:
                try:
                    chunk = await self._within(anext(raw), deadline)
                except StopAsyncIteration:
                    break
                yield chunk
        finally:
            await self._close(response)

    async def _close(self, response: httpx.Response) -> None:
        await response.aclose()  # sets elapsed: from sending the request to now
        self.metrics.upstream_seconds.labels(phase="total").observe(response.elapsed.total_seconds())

    async def _within(self, step: Awaitable[T], deadline: float) -> T:
        remaining = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(step, max(remaining, 0.0))
        except TimeoutError:
            raise LLMTimeout(
                f"the LLM server at {self.where} did not answer within {self.timeout_s:g}s (--llm_timeout_s)"
            ) from None
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise self._unavailable(exc) from None
            raise LLMTimeout(
                f"the LLM server at {self.where} did not answer within {self.timeout_s:g}s (--llm_timeout_s)"
            ) from None
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from None

    def _unavailable(self, exc: Exception) -> LLMUnavailable:
        return LLMUnavailable(
            f"the LLM server at {self.where} cannot be reached ({type(exc).__name__}); is it running? (--llm_url)"
        )

    async def aclose(self) -> None:
        await self.client.aclose()
