"""The outermost ASGI layer: bearer-key check, the draining refusal, active_requests, requests_total{code}.

Probes (/health, /ready, /metrics: what orchestrators and scrapers poll) count in probes_total{path,code},
never in requests_total, so a Kubernetes probe every few seconds does not drown the request metrics.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, so the request's `receive` stays the
server's own: the /encode handler needs it to notice a client that disconnects while its images queue.
While the Service drains, this is the one place that refuses: /encode gets 503 not_ready (and the
connection closes) and /ready says "shutting down", so a load balancer stops sending work.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitserve.errors import NotReady, Unauthorized, VitserveError, http_error, openai_error
from vitserve.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
WORK_PATHS = frozenset({"/encode", "/v1/chat/completions"})
# The front door's routes answer errors in OpenAI's shape (errors.openai_error), the edge's refusals too.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/models"})
READY_PATH = "/ready"


class ServerState:
    """What the Service and the edge share: the draining flag and the number of /encode requests served now."""

    def __init__(self) -> None:
        self.draining = False  # set once by Service's drain; never cleared
        self.active_requests = 0


async def send_error(
    send: Send, err: VitserveError, extra_headers: list[tuple[bytes, bytes]] | None = None, *, path: str = ""
) -> None:
    status, headers, body = openai_error(err) if path in OPENAI_PATHS else http_error(err)
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class Edge:
    def __init__(self, app: ASGIApp, *, api_key: str | None, state: ServerState, metrics: Metrics):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.state = state
        self.metrics = metrics

    def _authorized(self, scope: Scope) -> bool:
        if self.key is None or scope["path"] in OPEN_PATHS:
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, self.key)  # constant time: no key-prefix oracle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._dispatch(scope, receive, counting_send)
        finally:
            code = str(status_seen[0]) if status_seen else "499"  # 499: client left before an answer
            if scope["path"] in PROBE_PATHS:
                self.metrics.probes_total.labels(path=scope["path"], code=code).inc()
            else:
                self.metrics.requests_total.labels(code=code).inc()

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            err = Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>' (--api_key)")
            await send_error(send, err, [(b"www-authenticate", b"Bearer")], path=scope["path"])
            return
        if self.state.draining and scope["path"] == READY_PATH:
            await send_error(send, NotReady("not ready: shutting down"))
            return
        if scope["path"] not in WORK_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await send_error(
                send,
                NotReady("vitserve is shutting down and accepts no new work"),
                [(b"connection", b"close")],
                path=scope["path"],
            )
            return
        self.state.active_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.active_requests -= 1
