"""The Service lifecycle in-process (the real Engine over a ThreadGroup, so the queue can be held still): drain,
exit codes, banner."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from dataclasses import replace

import httpx
import pytest

from tests.e2e.live import TEST_CONFIG, live_server, noise_png, run_to_exit, wait_until
from tests.fakes import ThreadGroup, TinyEncoder
from vitserve.api.listen import bind_socket
from vitserve.api.server import Service, warmup_image
from vitserve.cli import render_banner
from vitserve.engine import Engine
from vitserve.errors import ConfigError
from vitserve.flags import FLAGS
from vitserve.metrics import Metrics
from vitserve.processors import load_image_processor

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
        "tp=1, dp=1",
        "reserved memory per rank: rank 0: 512.0 MiB, reserved_source=override",
        "max_queue_tokens=999",
        "max_images_per_request=32",
        "max_request_bytes=67108864",
        "max_image_pixels=50000000",
        "request_timeout_s=30",
        "cache_gb=0.0",
        "jpeg_draft=off",
        "output: exact (matches transformers)",
        f"http://127.0.0.1:{srv.service.port}",
    ):
        assert needle in text, needle
    assert "NOT exact" not in text


def _leaves(body: dict, prefix: str = ""):
    for key, value in body.items():
        if isinstance(value, dict) and key not in ("processor_clamp", "reserved_memory_bytes"):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, key, value


def test_banner_lists_every_setting_of_v1_info():
    """The banner is rendered from the /v1/info body: every setting the route gives, the banner shows."""
    with (
        live_server(
            max_queue_tokens=999, visual_reserved_mem_gb=0.5, api_key="sekret-key", cache_gb=0.25
        ) as srv,
        srv.client(headers={"authorization": "Bearer sekret-key"}) as c,
    ):
        text = render_banner(srv.service)
        body = c.get("/v1/info").json()
    leaves = list(_leaves(body))
    assert len(leaves) >= 25
    for path, key, value in leaves:
        if key == "version":
            assert f"vitserve {value} serving on" in text
        elif key == "processor_clamp":
            assert str(value) in text
        elif key == "reserved_memory_bytes":
            assert all(f"rank {r}: " in text for r in value), path
        elif key == "exact":
            assert "output: exact (matches transformers)" in text
        else:
            assert f"{key}=" in text, path
    assert "api_key=on" in text  # whether a key is set, never the key
    assert "sekret-key" not in text


# The flags that are no key of /v1/info: none of them guards memory, load or exactness. Where the server listens
# (the banner's URL), what it logs and traces, and how the nodes meet (node 0 serves HTTP).
NOT_GUARDS = {"host", "port", "log_level", "otlp_endpoint", "node_rank", "master_addr", "master_port"}
# The flags /v1/info names as docs/design.md names the concept ("Names").
RENAMED = {"visual_batch_max_tokens": "budget_tokens", "visual_infer_batch_size": "max_batch_images"}
RENAMED["model_family"] = "family"  # the family the ranks resolved (--model_family auto included)
RENAMED["wire_key_file"] = "wire_key"  # whether a key is set, never the key or its path


def test_v1_info_names_every_flag_that_guards_memory_load_or_exactness():
    """A new flag fails here until /v1/info (and so the banner) shows it, or it is listed as no guard above."""
    with live_server() as srv, srv.client() as c:
        body = c.get("/v1/info").json()
    keys = {key for _, key, _ in _leaves(body)}
    missing = [flag for flag in FLAGS if flag not in NOT_GUARDS and RENAMED.get(flag, flag) not in keys]
    assert not missing, f"flags in neither /v1/info nor NOT_GUARDS: {missing}"
    assert not (NOT_GUARDS & keys), "a flag listed as no guard is in /v1/info: drop it from NOT_GUARDS"
    assert body["image_resize"] == body["processor_clamp"]["image_resize"] == "torch"  # auto, resolved


def test_banner_says_when_output_is_not_exact():
    with live_server(jpeg_draft=True) as srv:
        text = render_banner(srv.service)
    assert "jpeg_draft=on" in text
    assert "output: NOT exact: --jpeg_draft is on (docs/jpeg_draft.md)" in text
    assert "output: exact" not in text


def test_budget_off_is_said_in_the_banner(caplog):
    caplog.set_level(logging.INFO)
    with live_server(visual_batch_max_tokens=0) as srv:
        assert "OFF (no clamp)" in render_banner(srv.service)
        assert "max_queue_tokens=unlimited" in render_banner(srv.service)


def test_stop_during_startup_cancels_the_start_and_exits_0():
    config = replace(TEST_CONFIG, heartbeat_s=1.0)
    metrics = Metrics()
    processor = load_image_processor("qwen2_5_vl", budget_tokens=config.visual_batch_max_tokens)
    gate = threading.Event()  # cleared: the rank holds the warm-up batch, so start-up cannot finish
    engine = Engine(
        config,
        metrics,
        encoder_factory=lambda _config: TinyEncoder(),
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
        warmup_image=warmup_image(processor),
    )
    service = Service(config, engine, lambda _config: processor, metrics, sock=bind_socket("127.0.0.1", 0))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=asyncio.run(service.run())), daemon=True)
    thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{service.port}", timeout=10) as c:
        warming = "not ready: encoder ranks are up; running the warm-up encode"
        wait_until(lambda: c.get("/ready").json()["error"]["message"] == warming, "the warm-up in flight")
        assert c.get("/health").status_code == 200  # liveness answers during start-up
    service.request_stop()  # what SIGTERM does; a signal would make the exit code 128 + N
    thread.join(30)
    assert result == {"code": 0}
    assert not service.started.is_set()  # the start was cancelled, not finished
    assert engine.readiness().reason == "shutting down"
    assert metrics.value("vitserve_requests_total", code="503") is None  # the /ready polls are probes


def test_the_app_is_built_once_after_the_start_and_a_refusal_then_exits_2(capfd):
    """The processor and the app are built once, from the Config the engine's start returned (never before:
    until then the start-up app answers). A setting refused there exits 2 with one line, as the CLI's checks
    before the ranks do, and stops the ranks that are running by then."""
    metrics = Metrics()
    processor = load_image_processor("qwen2_5_vl", budget_tokens=TEST_CONFIG.visual_batch_max_tokens)
    open_gate = threading.Event()
    open_gate.set()  # the rank encodes the warm-up at once: the start finishes
    engine = Engine(
        TEST_CONFIG,
        metrics,
        encoder_factory=lambda _config: TinyEncoder(),
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=open_gate),
        warmup_image=warmup_image(processor),
    )
    built: list[object] = []

    def processor_for(config):
        built.append(config)
        raise ConfigError("--some_flag refused once the ranks are up")

    service = Service(TEST_CONFIG, engine, processor_for, metrics, sock=bind_socket("127.0.0.1", 0))
    assert (service.app, built) == (None, [])  # nothing of the app before the engine's start
    assert run_to_exit(service) == 2
    assert built == [TEST_CONFIG]  # once, with the Config the start returned
    assert service.app is None
    assert not service.started.is_set()
    assert engine.readiness().reason == "shutting down"  # the ranks were stopped
    err = capfd.readouterr().err
    assert "vitserve: start-up failed: --some_flag refused once the ranks are up" in err
    assert "Traceback" not in err
