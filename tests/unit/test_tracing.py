"""vitserve/api/tracing.py: the W3C traceparent rules, the stage layout, and no OpenTelemetry SDK when off."""

from __future__ import annotations

import sys

import pytest

from tests.fakes import fake_item
from vitserve.api.tracing import (
    RequestTrace,
    make_tracing,
    parse_traceparent,
    stage_spans,
    traces_url,
)
from vitserve.contract import ItemResult, PreparedImage, StageTimes
from vitserve.errors import ConfigError
from vitserve.flags import build_config

pytestmark = pytest.mark.unit
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("header", "valid"),
    [
        (f"00-{TRACE}-{PARENT}-01", True),
        (f" 00-{TRACE}-{PARENT}-00 ", True),  # surrounding spaces are tolerated
        (f"01-{TRACE}-{PARENT}-01-future-field", True),  # a later version may append fields
        (f"00-{TRACE}-{PARENT}-01-extra", False),  # version 00 has exactly four fields
        (f"ff-{TRACE}-{PARENT}-01", False),  # version ff is invalid
        (f"00-{'0' * 32}-{PARENT}-01", False),  # all-zero trace id
        (f"00-{TRACE}-{'0' * 16}-01", False),  # all-zero parent id
        (f"00-{TRACE.upper()}-{PARENT}-01", False),  # hex is lowercase
        (f"00-{TRACE[:-1]}-{PARENT}-01", False),
        ("", False),
        (None, False),
    ],
)
def test_traceparent_rules(header, valid):
    parsed = parse_traceparent(header)
    assert (parsed is not None) is valid
    if valid:
        assert (parsed.trace_id, parsed.span_id) == (TRACE, PARENT)


def test_off_keeps_the_callers_trace_with_a_span_id_of_its_own():
    trace = RequestTrace(f"00-{TRACE}-{PARENT}-01")
    own = parse_traceparent(trace.traceparent)
    assert (own.trace_id, own.flags) == (TRACE, "01")
    assert own.span_id != PARENT
    fresh = [parse_traceparent(RequestTrace(h).traceparent) for h in (None, "junk", None)]
    assert all(f.trace_id != TRACE and f.flags == "00" for f in fresh), "off records nothing: not sampled"
    assert len({f.trace_id for f in fresh}) == 3


def _image(seed: int) -> PreparedImage:
    return PreparedImage(fake_item(2, 2, seed), f"id{seed}", (56, 56), decode_s=0.002, preprocess_s=0.001)


def _result(queue_ms: float, encode_ms: float, send_ms: float, cached: bool = False) -> ItemResult:
    return ItemResult(4, None, cached=cached, timing=StageTimes(queue_ms, encode_ms, send_ms))


def test_stage_layout_follows_the_engine_order():
    """Image 1 is encoded before image 0 is handed over: its handoff waits for image 0's."""
    ms = 1_000_000
    results = [_result(2, 10, 3), _result(2, 5, 1), _result(0, 0, 1, cached=True)]
    spans = stage_spans(
        [_image(0), _image(1), _image(2)],
        results,
        decode_ns=(0, 5 * ms),
        engine_ns=(5 * ms, 100 * ms),
        handoff=True,
    )
    got = {
        (s.name, s.attributes.get("vitserve.image_index")): (s.start_ns // ms, s.end_ns // ms) for s in spans
    }
    assert got == {
        ("decode", None): (0, 5),
        ("queue", 0): (5, 7),
        ("encode", 0): (7, 17),
        ("handoff", 0): (17, 20),
        ("queue", 1): (5, 7),
        ("encode", 1): (7, 12),
        ("handoff", 1): (20, 21),  # after image 0's handoff, not at its own encode's end
        ("handoff", 2): (21, 22),  # a cache hit: no queue, no encode
    }
    decode = spans[0].attributes
    assert (decode["vitserve.decode_ms"], decode["vitserve.preprocess_ms"]) == (6.0, 3.0)


def test_stage_layout_never_ends_after_the_engine_answered():
    ms = 1_000_000
    spans = stage_spans(
        [_image(0)], [_result(50, 50, 50)], decode_ns=(0, 0), engine_ns=(0, 60 * ms), handoff=False
    )
    assert max(s.end_ns for s in spans) == 60 * ms
    assert "handoff" not in {s.name for s in spans}, "no --llm_endpoint, no handoff"


def test_traces_url_appends_the_signal_path_once():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/x/v1/traces") == "https://c/x/v1/traces"


@pytest.mark.parametrize("value", ["collector:4318", "grpc://c:4317", "http://"])
def test_otlp_endpoint_must_be_an_http_url(value):
    with pytest.raises(ConfigError, match="--otlp_endpoint"):
        build_config(["--otlp_endpoint", value], {})
    assert build_config([], {"VITSERVE_OTLP_ENDPOINT": "http://c:4318"}).otlp_endpoint == "http://c:4318"
    assert build_config([], {}).otlp_endpoint is None


def test_on_without_the_extra_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"vitserve\[tracing\]"):
        make_tracing("http://127.0.0.1:4318", handoff=False)
