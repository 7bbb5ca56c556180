"""--otlp_endpoint end to end: a real server exports /encode's spans to an OTLP/HTTP collector in the test.

The collector is a plain HTTP server that accepts POST /v1/traces and decodes the protobuf body with
OpenTelemetry's own message classes (opentelemetry-proto), as a real collector would. The LLM side is a real
EmbeddingReceiver on an ipc socket, so the handoff stage runs.
"""

from __future__ import annotations

import http.server
import re
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.cli import Cli
from tests.e2e.live import live_server, noise_png, wait_until
from tests.e2e.test_cli_process import BASE_ARGS, FAST_START
from tests.fakes import thread_engine
from vitserve.rpc import EmbeddingReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict


class Collector(http.server.ThreadingHTTPServer):
    """Accepts OTLP/HTTP protobuf exports on /v1/traces and keeps the spans."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CollectorHandler)
        self.spans: list[Span] = []
        self.resources: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _CollectorHandler(http.server.BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        export = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for rs in export.resource_spans:
                self.server.resources.append({a.key: _value(a.value) for a in rs.resource.attributes})
                for ss in rs.scope_spans:
                    self.server.spans.extend(
                        Span(
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.name,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                        for s in ss.spans
                    )
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    server = Collector()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture
def traced(collector, tmp_path, monkeypatch):
    """A live server with --otlp_endpoint and --llm_endpoint; the engine's requests are recorded."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms, not every 5 s
    endpoint = f"ipc://{tmp_path}/llm.sock"
    receiver = EmbeddingReceiver(endpoint, bind=True)
    received: list = []
    stop = threading.Event()

    def receive() -> None:  # the LLM side: hands every message to the application at once
        while not stop.is_set():
            try:
                received.append(receiver.recv(timeout_s=0.2))
            except TimeoutError:
                continue

    seen: list = []

    open_gate = threading.Event()
    open_gate.set()  # batches run at once

    def make_engine(config, metrics):
        engine = thread_engine(config, metrics, gate=open_gate)
        engine_encode = engine.encode

        async def encode(request):
            seen.append(request)
            return await engine_encode(request)

        engine.encode = encode
        return engine

    receiving = threading.Thread(target=receive, daemon=True)
    receiving.start()
    with live_server(otlp_endpoint=collector.url, llm_endpoint=endpoint, make_engine=make_engine) as live:
        yield live, seen, received
    stop.set()
    receiving.join(5)
    receiver.close()


def test_spans_arrive_with_the_callers_trace_and_parent(traced, collector):
    live, seen, received = traced
    images = [noise_png(64, 48, seed=1), noise_png(40, 72, seed=2)]
    with live.client() as c:
        r = c.post(
            "/encode",
            files=[("images", (f"{i}.png", img, "image/png")) for i, img in enumerate(images)],
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
    assert r.status_code == 200, r.text
    trace_id, span_id, flags = TRACEPARENT.fullmatch(r.headers["traceparent"]).groups()
    assert (trace_id, flags) == (TRACE_ID, "01")
    assert span_id != PARENT_ID, "vitserve's own span id"
    assert seen[-1].traceparent == r.headers["traceparent"], "the engine (and the wire) get the same context"
    wait_until(lambda: len(received) == 2, "both embeddings reach the LLM side")

    wait_until(lambda: len(collector.of_trace(TRACE_ID)) >= 8, "the request's spans reach the collector")
    spans = collector.of_trace(TRACE_ID)
    (root,) = [s for s in spans if s.name == "POST /encode"]
    assert (root.span_id, root.parent_id) == (span_id, PARENT_ID)
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["vitserve.request_id"] == r.json()["request_id"]
    children = [s for s in spans if s is not root]
    assert sorted(s.name for s in children) == sorted(["decode"] + ["queue", "encode", "handoff"] * 2)
    for s in children:
        assert s.parent_id == root.span_id
        assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, s
    for index in (0, 1):
        stage = {s.name: s for s in children if s.attributes.get("vitserve.image_index") == index}
        assert stage["queue"].end_ns == stage["encode"].start_ns <= stage["handoff"].start_ns
        assert stage["encode"].end_ns > stage["encode"].start_ns, "the encode took time"
    decode = next(s for s in children if s.name == "decode")
    assert decode.end_ns <= min(s.start_ns for s in children if s.name == "queue")
    assert collector.resources[0]["service.name"] == "vitserve"


def test_a_missing_or_malformed_traceparent_starts_a_new_trace(traced, collector):
    live, seen, _ = traced
    image = noise_png(32, 32, seed=3)
    bad = f"00-{TRACE_ID}-{'0' * 16}-01"  # an all-zero parent id is invalid
    ids = []
    with live.client() as c:
        for headers in ({}, {"traceparent": bad}, {"traceparent": "garbage"}):
            r = c.post("/encode", files=[("images", ("a.png", image, "image/png"))], headers=headers)
            assert r.status_code == 200, r.text
            trace_id, span_id, _ = TRACEPARENT.fullmatch(r.headers["traceparent"]).groups()
            assert trace_id != TRACE_ID
            ids.append((trace_id, span_id))
    assert len({t for t, _ in ids}) == 3, "each request its own trace"
    for trace_id, span_id in ids:
        wait_until(lambda t=trace_id: collector.of_trace(t), f"trace {trace_id} exported")
        (root,) = [s for s in collector.of_trace(trace_id) if s.name == "POST /encode"]
        assert (root.span_id, root.parent_id) == (span_id, "")


def test_an_error_response_carries_the_traceparent_and_a_span(traced, collector):
    live, _, _ = traced
    with live.client() as c:
        r = c.post(
            "/encode",
            json={"images": [{"b64": "not base64!"}]},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
    assert r.status_code == 400
    trace_id, span_id, _ = TRACEPARENT.fullmatch(r.headers["traceparent"]).groups()
    assert trace_id == TRACE_ID
    wait_until(lambda: any(s.span_id == span_id for s in collector.of_trace(TRACE_ID)), "the span exported")
    (root,) = [s for s in collector.of_trace(TRACE_ID) if s.span_id == span_id]
    assert root.attributes["http.response.status_code"] == 400
    assert not [s for s in collector.of_trace(TRACE_ID) if s.parent_id == span_id], "no stage ran"


def test_the_cli_exports_what_is_buffered_when_it_drains_on_sigterm(collector, tmp_path, monkeypatch):
    """The real `vitserve --otlp_endpoint ...` process; the batch delay is longer than the test, so the
    spans can only arrive through the flush at exit, after the SIGTERM drain."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    srv = Cli([*BASE_ARGS, *FAST_START, "--otlp_endpoint", collector.url], tmp_path)
    try:
        srv.wait_started()
        r = httpx.post(
            f"{srv.url}/encode",
            files=[("images", ("a.png", noise_png(48, 48, seed=4), "image/png"))],
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        time.sleep(0.5)
        assert collector.of_trace(TRACE_ID) == [], "nothing is exported before the batch delay or exit"
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.text[-3000:]
    finally:
        srv.stop()
    names = sorted(s.name for s in collector.of_trace(TRACE_ID))
    assert names == ["POST /encode", "decode", "encode", "queue"], names  # no --llm_endpoint: no handoff
