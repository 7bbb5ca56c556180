"""W3C trace context on /encode and, with --otlp_endpoint, its stages as OTLP spans (docs/tracing.md).

Every /encode request gets vitserve's own traceparent: the caller's trace id (a new one when the header is
absent or malformed) and a span id of vitserve's. It goes to the engine in EncodeRequest.traceparent (so
the LLM side can join the trace) and back in the response's `traceparent` header.

Off (the default) this module only parses the header: OpenTelemetry's SDK and exporter are never imported.
On, the request's span and one span per stage (decode; then per image queue, encode, handoff) are built
after the response, from the stage durations the engine already records (contract.StageTimes), on a
thread of this module's, and handed to OpenTelemetry's BatchSpanProcessor, which exports them over
OTLP/HTTP from its own thread.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vitserve
from vitserve.contract import ItemResult, PreparedImage
from vitserve.errors import ConfigError

if TYPE_CHECKING:  # imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)
# version-traceid-parentid-flags; a version above 00 may append fields (W3C Trace Context, section 3.2)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SPAN_NAME = "POST /encode"


@dataclass(frozen=True)
class TraceParent:
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits: the parent's, as received, or vitserve's own
    flags: str  # 2 hex digits; 01 = sampled

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The header's fields, or None when it is absent or not a valid W3C traceparent."""
    m = _TRACEPARENT.fullmatch(value.strip()) if value else None
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, flags)


@dataclass(frozen=True)
class StageSpan:
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def stage_spans(
    prepared: Sequence[PreparedImage],
    results: Sequence[ItemResult],
    *,
    decode_ns: tuple[int, int],
    engine_ns: tuple[int, int],
    handoff: bool,
) -> list[StageSpan]:
    """The request's stages laid out in wall time from the durations the engine records.

    decode covers fetching, decoding and preprocessing every image. Per image, queue starts when the
    engine got the request and encode follows it; images are handed to the LLM in order, each once it is
    encoded and the one before it was handed over (engine/engine.py), so handoff k starts at the later
    of the two. Nothing ends after the engine answered. For an image another request was already encoding,
    queue and encode are that encode's."""
    spans = [
        StageSpan(
            "decode",
            *decode_ns,
            {
                "vitserve.images": len(prepared),
                "vitserve.decode_ms": round(sum(p.decode_s for p in prepared) * 1e3, 3),
                "vitserve.preprocess_ms": round(sum(p.preprocess_s for p in prepared) * 1e3, 3),
            },
        )
    ]
    start, done = engine_ns
    handed = start
    for index, (p, r) in enumerate(zip(prepared, results, strict=True)):
        attributes = {
            "vitserve.image_index": index,
            "vitserve.image_id": p.image_id,
            "vitserve.num_tokens": r.num_tokens,
            "vitserve.cached": r.cached,
        }
        queued = min(start + int(r.timing.queue_ms * 1e6), done)
        encoded = min(queued + int(r.timing.encode_ms * 1e6), done)
        if not r.cached or r.timing.queue_ms or r.timing.encode_ms:  # a cache hit has neither stage
            spans.append(StageSpan("queue", start, queued, attributes))
            spans.append(StageSpan("encode", queued, encoded, attributes))
        if handoff:
            begin = max(encoded, handed)
            handed = min(begin + int(r.timing.send_ms * 1e6), done)
            spans.append(StageSpan("handoff", min(begin, handed), handed, attributes))
    return spans


class RequestTrace:
    """One /encode request's trace context. This base records nothing (tracing off)."""

    def __init__(self, header: str | None):
        incoming = parse_traceparent(header)
        trace_id = incoming.trace_id if incoming else secrets.token_hex(16)
        flags = incoming.flags if incoming else "00"  # not sampled: nothing of it is recorded here
        self.traceparent = TraceParent(trace_id, secrets.token_hex(8), flags).header()

    def mark(self, stage: str) -> None:
        """Record that `stage` ("decode", "engine") starts now."""

    def record(
        self, request_id: str, prepared: Sequence[PreparedImage], results: Sequence[ItemResult]
    ) -> None:
        """The request's id, its images and the engine's results, once it answered."""

    def finish(self, status: int) -> None:
        """The request ended with this HTTP status."""


class Tracing:
    """Per app: starts a RequestTrace per /encode request. This base exports nothing (tracing off)."""

    def start(self, header: str | None) -> RequestTrace:
        return RequestTrace(header)

    def shutdown(self) -> None:
        """Export what is still buffered."""


def make_tracing(otlp_endpoint: str | None, *, handoff: bool) -> Tracing:
    """Tracing() when --otlp_endpoint is not set; else the OTLP one (needs the `tracing` extra)."""
    if otlp_endpoint is None:
        return Tracing()
    try:
        return _OtlpTracing(otlp_endpoint, handoff=handoff)
    except ImportError as exc:
        raise ConfigError(
            f"--otlp_endpoint needs OpenTelemetry ({exc.name} is missing): pip install 'vitserve[tracing]'"
        ) from None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: like OTEL_EXPORTER_OTLP_ENDPOINT, a base URL gets /v1/traces appended."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class _OtlpTracing(Tracing):
    def __init__(self, endpoint: str, *, handoff: bool):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # A provider of our own, not the global one: two apps in one process (tests) do not share it.
        # It flushes at interpreter exit; OTEL_BSP_* variables tune the batching.
        resource = Resource.create({"service.name": "vitserve", "service.version": vitserve.__version__})
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("vitserve", vitserve.__version__)
        self.handoff = handoff
        # Building a request's spans costs ~0.1 ms each in the SDK (up to ~100 for 32 images): done here,
        # off the event loop. Interpreter exit joins this thread before the provider's final flush.
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitserve-trace")

    def start(self, header: str | None) -> RequestTrace:
        return _OtlpRequestTrace(self, header)

    def shutdown(self) -> None:
        self.builder.shutdown(wait=True)
        self.provider.shutdown()


class _OtlpRequestTrace(RequestTrace):
    def __init__(self, tracing: _OtlpTracing, header: str | None):
        from opentelemetry import trace

        self.tracing = tracing
        self.marks: dict[str, int] = {}
        self.prepared: Sequence[PreparedImage] = ()
        self.results: Sequence[ItemResult] = ()
        incoming = parse_traceparent(header)
        parent = None
        if incoming is not None:
            remote = trace.SpanContext(
                int(incoming.trace_id, 16),
                int(incoming.span_id, 16),
                is_remote=True,
                trace_flags=trace.TraceFlags(int(incoming.flags, 16)),
            )
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        self.span: Span = tracing.tracer.start_span(_SPAN_NAME, context=parent, kind=trace.SpanKind.SERVER)
        ctx = self.span.get_span_context()
        self.traceparent = TraceParent(
            f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{int(ctx.trace_flags):02x}"
        ).header()

    def mark(self, stage: str) -> None:
        self.marks[stage] = time.time_ns()

    def record(
        self, request_id: str, prepared: Sequence[PreparedImage], results: Sequence[ItemResult]
    ) -> None:
        self.span.set_attribute("vitserve.request_id", request_id)
        self.prepared, self.results = prepared, results
        self.marks["done"] = time.time_ns()

    def finish(self, status: int) -> None:
        self.tracing.builder.submit(self._export, status, time.time_ns())

    def _export(self, status: int, end_ns: int) -> None:
        try:
            self._build(status, end_ns)
        except Exception:  # a bug here must not go unseen in a thread nobody awaits
            log.exception("building the spans of an /encode request failed")

    def _build(self, status: int, end_ns: int) -> None:
        from opentelemetry import trace

        self.span.set_attribute("http.request.method", "POST")
        self.span.set_attribute("http.route", "/encode")
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(trace.StatusCode.ERROR)
        if self.results:  # the engine answered: lay out its stages under the request's span
            parent = trace.set_span_in_context(self.span)
            spans = stage_spans(
                self.prepared,
                self.results,
                decode_ns=(self.marks["decode"], self.marks["engine"]),
                engine_ns=(self.marks["engine"], self.marks["done"]),
                handoff=self.tracing.handoff,
            )
            for s in spans:
                child = self.tracing.tracer.start_span(
                    s.name, context=parent, start_time=s.start_ns, attributes=s.attributes
                )
                child.end(end_time=s.end_ns)
        self.span.end(end_time=end_ns)
