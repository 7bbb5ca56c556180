"""The Service lifecycle in-process (the real Engine over a ThreadGroup, so the queue can be held still): drain,
exit codes, banner."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from tests.e2e.live import live_server, noise_png, wait_until
from vitserve.cli import render_banner

pytestmark = pytest.mark.timeout(120)


def test_stop_drains_in_flight_refuses_new_and_exits_0():
    img = noise_png(120, 90)
    with live_server() as srv:
        srv.gate.clear()
        held: list[httpx.Response] = []

        def send():
            with srv.client() as c:
                held.append(c.post("/encode", files=[("images", ("a.png", img))]))

        t = threading.Thread(target=send)
        t.start()
        wait_until(
            lambda: srv.metrics.value("vitserve_batch_images_count") == 1, "the first request in flight"
        )
        srv.service.request_stop()  # what SIGTERM does
        wait_until(lambda: srv.service.state.draining, "draining")
        with srv.client() as c:
            late = c.post("/encode", files=[("images", ("b.png", img))])
            assert late.status_code == 503
            assert late.json()["error"]["code"] == "not_ready"
            assert c.get("/ready").status_code == 503
            assert c.get("/health").status_code == 200
        srv.gate.set()
        t.join(30)
    assert [r.status_code for r in held] == [200]
    assert srv.result["code"] == 0


def test_engine_with_no_group_left_exits_nonzero():
    with live_server() as srv:
        loop = srv.service._loop
        loop.call_soon_threadsafe(srv.engine.failed.set)
        wait_until(lambda: "code" in srv.result, "the service stopped on its own")
    assert srv.result["code"] == 1


def test_banner_names_every_guard():
    with live_server(max_queue_tokens=999, visual_reserved_mem_gb=0.5) as srv:
        text = render_banner(srv.service)
    for needle in (
        "256 tokens per batch and per image",
        "processor clamp: {",
        "'max_pixels'",
        "tp=1 dp=1",
        "rank 0:",
        "source: override",
        "max_queue_tokens=999",
        "max_images_per_request=32",
        "max_request_bytes=67108864",
        "max_image_pixels=50000000",
        "request_timeout_s=30",
        "cache: off",
        "jpeg_draft: off",
        "output: exact (matches transformers)",
        f"http://127.0.0.1:{srv.service.port}",
    ):
        assert needle in text, needle
    assert "NOT exact" not in text


def test_banner_says_when_output_is_not_exact():
    with live_server(jpeg_draft=True) as srv:
        text = render_banner(srv.service)
    assert "jpeg_draft: on" in text
    assert "output: NOT exact: --jpeg_draft is on (docs/jpeg_draft.md)" in text
    assert "output: exact" not in text


def test_budget_off_is_said_in_the_banner(caplog):
    caplog.set_level(logging.INFO)
    with live_server(visual_batch_max_tokens=0) as srv:
        assert "OFF (no clamp)" in render_banner(srv.service)
        assert "max_queue_tokens=unlimited" in render_banner(srv.service)
