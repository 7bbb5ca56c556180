"""The FastAPI application: the routes, and the one handler that turns any exception into a typed error
(rendered by errors.http_error, like the edge's refusals)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

import vitserve
from vitserve import preflight
from vitserve.api.chat import CHAT_ROUTE, MODELS_ROUTE, ChatHandler
from vitserve.api.edge import Edge, ServerState
from vitserve.api.encode import EncodeHandler
from vitserve.api.info import info_body
from vitserve.api.media import MediaPipeline
from vitserve.api.openapi import DOCS_ASSETS_URL, ENCODE_OPENAPI, ERROR_RESPONSES, add_schemas
from vitserve.api.preprocess import Preprocessor
from vitserve.api.tracing import Tracing, make_tracing
from vitserve.api.videos import VideoFrontEnd
from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.contract import Engine
from vitserve.errors import InvalidRequest, NotReady, VitserveError, http_error
from vitserve.handover.base import Setup, Transport
from vitserve.handover.embeds import EmbedsLayout
from vitserve.handover.transports import open_transport
from vitserve.handover.upstream import Upstream
from vitserve.metrics import CONTENT_TYPE, Metrics
from vitserve.processors.base import VisionProcessor

log = logging.getLogger(__name__)
_HTTP_CODES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def error_response(err: VitserveError, *, level: int = logging.WARNING) -> Response:
    """A typed error as the route's answer, rendered by errors.http_error like the edge's refusals; a
    5xx is logged at `level`."""
    if err.status >= 500:
        log.log(level, "%s: %s", err.code, err.message)
    status, headers, body = http_error(err)
    return Response(body, status_code=status, headers=headers)


def _as_vitserve_error(exc: Exception) -> VitserveError:
    if isinstance(exc, VitserveError):
        return exc
    if isinstance(exc, RequestValidationError):
        return InvalidRequest("the request does not match the API schema")
    if isinstance(exc, StarletteHTTPException):
        err = VitserveError(str(exc.detail))
        err.status, err.code = exc.status_code, _HTTP_CODES.get(exc.status_code, "invalid_request")
        return err
    log.exception("unhandled error: %r", exc)
    return VitserveError("internal error; see the server log")


async def _handle(request: Request, exc: Exception) -> Response:
    response = error_response(_as_vitserve_error(exc))
    traceparent = getattr(request.state, "traceparent", None)  # set by /encode (api/tracing.py)
    if traceparent is not None:
        response.headers["traceparent"] = traceparent
    return response


def create_app(
    config: Config,
    engine: Engine,
    processor: VisionProcessor,
    metrics: Metrics,
    *,
    state: ServerState | None = None,
) -> FastAPI:
    """The ASGI app. `state` lets the entry point flip `draining` on SIGTERM; app.state.server holds it."""
    state = state or ServerState()
    # /docs and /redoc with Swagger UI / ReDoc files from the installed fastapi-offline package, never a
    # CDN: sidecars often run with no internet. Like every route but /health they need --api_key when set.
    # validatorUrl None: Swagger UI would otherwise send the spec to an online validator for its badge.
    app = FastAPIOffline(
        title="vitserve",
        version=vitserve.__version__,
        static_url=DOCS_ASSETS_URL,
        swagger_ui_parameters={"validatorUrl": None},
        description="Vision-encoder embeddings for multimodal LLMs (docs/api.md).",
    )
    app.state.server = state
    app.state.preprocessor = pre = Preprocessor(
        processor, max_image_pixels=config.max_image_pixels, metrics=metrics, jpeg_draft=config.jpeg_draft
    )
    app.state.tracing = tracing = make_tracing(config.otlp_endpoint, handoff=config.llm_endpoint is not None)
    # decoders start with the first video; --video_decoders 0: the server takes no videos
    videos = VideoFrontEnd(config, processor) if config.video_decoders else None
    app.state.videos = videos
    app.state.media = media = MediaPipeline(config, engine, pre, metrics, videos)
    encode = EncodeHandler(config, media, tracing)
    for exc_type in (VitserveError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, _handle)

    @app.post("/encode", openapi_extra=ENCODE_OPENAPI, responses=ERROR_RESPONSES)
    async def post_encode(request: Request) -> Response:
        """Encode images and videos; JSON (base64 or URL) or multipart (`images` and `videos` file parts)."""
        return await encode(request)

    if config.llm_url is not None:
        _add_front_door(app, config, media, processor, metrics, tracing)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:  # while draining, the edge answers instead
        readiness = engine.readiness()
        if not readiness.ready:  # polled every few seconds while starting: debug, not a warning
            return error_response(NotReady(f"not ready: {readiness.reason}"), level=logging.DEBUG)
        return JSONResponse({"status": "ready"})

    @app.get("/v1/info")
    async def v1_info() -> dict[str, Any]:
        return info_body(config, engine, processor)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(Edge, api_key=config.api_key, state=state, metrics=metrics)
    return app


def _add_front_door(
    app: FastAPI,
    config: Config,
    media: MediaPipeline,
    processor: VisionProcessor,
    metrics: Metrics,
    tracing: Tracing,
) -> None:
    """POST /v1/chat/completions and GET /v1/models in front of --llm_url (api/chat.py, docs/vllm.md)."""
    assert config.llm_url is not None
    upstream = Upstream(
        config.llm_url, api_key=config.llm_api_key, timeout_s=config.llm_timeout_s, metrics=metrics
    )
    app.state.upstream = upstream
    # the checkpoint the processor was built from (a family's defaults know no LLM: open --model)
    checkpoint = processor.checkpoint or Checkpoint.open(config.model, config.model_family)
    layout = EmbedsLayout(
        family=processor.family,
        merge_size=int(processor.clamp_info().get("merge_size", 1)),
        width=preflight.llm_embeds_width(checkpoint),
        tokens_per_second=(checkpoint.config.get("vision_config") or {}).get("tokens_per_second"),
    )
    # --llm_transport's, picked once (handover/transports.py); ec_storage takes over an earlier run's files now
    app.state.transport = transport = open_transport(
        Setup(config, layout, metrics, media.pre.run, lambda: media.engine.info().fingerprint)
    )
    chat = ChatHandler(config, media, tracing, upstream, transport)

    @app.post(CHAT_ROUTE, responses=ERROR_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions: image and video parts are encoded here and sent to the LLM server as
        embeddings."""
        return await chat(request)

    @app.get(MODELS_ROUTE)
    async def models(request: Request) -> Response:
        """The LLM server's model list, passed through."""
        return await chat.models(request)


async def close_app(app: FastAPI) -> None:
    """Release what create_app made: the preprocessing pool, the video decoders, the upstream
    connections and the transport."""
    app.state.preprocessor.close()
    if app.state.videos is not None:
        app.state.videos.close()
    upstream: Upstream | None = getattr(app.state, "upstream", None)
    if upstream is not None:
        await upstream.aclose()
    transport: Transport | None = getattr(app.state, "transport", None)
    if transport is not None:
        await transport.close()


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        app.openapi_schema = add_schemas(schema)
    return app.openapi_schema
