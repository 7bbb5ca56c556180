"""VitserveClient / AsyncVitserveClient against a real server and against addresses where none answers.

ready() and health() are probes: False when the server is unreachable (refused, DNS failure, timeout).
encode() and info() raise VitserveClientError for every failure, transport ones as status 0.
"""

from __future__ import annotations

import socket

import pytest

from tests.e2e.live import live_server, png_bytes
from vitserve import AsyncVitserveClient, VitserveClient, VitserveClientError

pytestmark = pytest.mark.timeout(120)
PROBE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def srv():
    with live_server() as live:
        yield live


def _refused_url() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(params=["refused", "dns_failure", "timeout"])
def unreachable(request):
    """A base URL where no HTTP answer will come, for each way a server can be unreachable."""
    if request.param == "refused":
        yield _refused_url()
    elif request.param == "dns_failure":
        yield "http://vitserve-test.invalid:8100"  # .invalid never resolves (RFC 2606)
    else:
        with socket.socket() as s:  # listens (the kernel accepts the connection) but never answers
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_probes_answer_false_when_unreachable(unreachable):
    with VitserveClient(unreachable, timeout=PROBE_TIMEOUT_S) as c:
        assert c.ready() is False
        assert c.health() is False


async def test_async_probes_answer_false_when_unreachable(unreachable):
    async with AsyncVitserveClient(unreachable, timeout=PROBE_TIMEOUT_S) as c:
        assert await c.ready() is False
        assert await c.health() is False


def test_other_calls_raise_a_typed_connection_error():
    with VitserveClient(_refused_url(), timeout=PROBE_TIMEOUT_S) as c:
        for call in (c.info, lambda: c.encode([png_bytes(16, 16)])):
            with pytest.raises(VitserveClientError) as exc:
                call()
            assert (exc.value.status, exc.value.code) == (0, "connection_error")
            assert "ConnectError" in exc.value.message


async def test_async_other_calls_raise_a_typed_connection_error():
    async with AsyncVitserveClient(_refused_url(), timeout=PROBE_TIMEOUT_S) as c:
        for call in (c.info, lambda: c.encode([png_bytes(16, 16)])):
            with pytest.raises(VitserveClientError) as exc:
                await call()
            assert (exc.value.status, exc.value.code) == (0, "connection_error")


def test_probes_answer_true_from_a_live_server_and_ready_follows_draining(srv):
    with VitserveClient(srv.url) as c:
        assert c.health() is True
        assert c.ready() is True
        srv.service.state.draining = True
        try:
            assert c.ready() is False  # 503 not_ready: up but not taking work
            assert c.health() is True
        finally:
            srv.service.state.draining = False
        assert c.ready() is True
        assert c.info()["version"]


async def test_async_probes_answer_true_from_a_live_server(srv):
    async with AsyncVitserveClient(srv.url) as c:
        assert await c.health() is True
        assert await c.ready() is True
        assert (await c.info())["version"]


def test_wrong_api_key_is_not_ready_and_info_raises_unauthorized():
    with live_server(api_key="s3cret") as live:
        with VitserveClient(live.url, api_key="wrong") as c:
            assert c.health() is True  # /health is open
            assert c.ready() is False
            with pytest.raises(VitserveClientError) as exc:
                c.info()
            assert (exc.value.status, exc.value.code) == (401, "unauthorized")
        with VitserveClient(live.url, api_key="s3cret") as c:
            assert c.ready() is True
