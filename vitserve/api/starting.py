"""What uvicorn serves while the ranks start, before the app exists.

The image processor and the app are built once, from the Config the engine's start decided (Service.run: the
flags' own, or with --visual_mem_gb alone the budget the ranks chose), so until the ranks are ready this
small app answers instead, behind the same edge (the API key, the probe counts): /health 200, /ready 503 with
the engine's reason, /metrics, and 503 not_ready on every other path.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from vitserve.api.edge import Edge, ServerState, send_error
from vitserve.config import Config
from vitserve.contract import Engine
from vitserve.errors import NotReady
from vitserve.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)


class _Starting:
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await _send(send, 200, json.dumps({"status": "ok"}).encode(), "application/json")
        elif path == "/metrics":
            await _send(send, 200, self.metrics.render(), CONTENT_TYPE)
        elif path == "/ready":  # polled every few seconds while starting: debug, not a warning
            reason = self.engine.readiness().reason
            log.debug("not_ready: not ready: %s", reason)
            await send_error(send, NotReady(f"not ready: {reason}"))
        else:
            await send_error(send, NotReady("encoder ranks are still starting"), path=path)


async def _send(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def starting_app(config: Config, engine: Engine, metrics: Metrics, state: ServerState) -> ASGIApp:
    """The start-up app behind the edge, with the flags' API key."""
    return Edge(_Starting(engine, metrics), api_key=config.api_key, state=state, metrics=metrics)
