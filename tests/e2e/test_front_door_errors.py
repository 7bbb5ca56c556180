"""The front door's failure paths on a real server (docs/vllm.md), without a vLLM: the LLM server is a real
TCP listener that accepts and records connections but never answers, or a port nobody listens on.

What a real vLLM answers is tested in tests/vllm/; these are the paths where vitserve must answer itself:
bad input never reaches the LLM server, an unreachable one is 502, a silent one 504, a client that leaves
closes the upstream connection, and errors come in OpenAI's shape.
"""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.live import live_server, png_bytes
from tests.fakes import TinyEncoder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
TEXT_HIDDEN = 48  # tests/checkpoints.py's language width: what the LLM expects of every row


class SilentPeer:
    """A listening socket on 127.0.0.1 that accepts connections, reads what they send, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.closed_by_client = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        with conn:
            while conn.recv(65536):
                pass
        self.closed_by_client.set()  # recv returned b"": the other side closed the connection

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)  # the accept loop is done before its socket closes
        self.sock.close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


def _chat(image: bytes, *, stream: bool = False) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("ckpt") / "qwen2_5_vl")


@pytest.fixture
def peer():
    p = SilentPeer()
    yield p
    p.close()


def _server(ckpt, llm_url, **overrides):
    return live_server(
        model=str(ckpt), llm_url=llm_url, encoder=TinyEncoder(embed_dim=TEXT_HIDDEN), **overrides
    )


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code", "param"}
    return body["error"]


def test_a_corrupt_image_is_400_in_openai_shape_and_never_goes_upstream(ckpt, peer):
    with _server(ckpt, peer.url, llm_timeout_s=2) as live, live.client() as c:
        r = c.post("/v1/chat/completions", json=_chat(b"\x89PNG\r\n\x1a\n not really a png"))
        assert r.status_code == 400
        err = _error(r)
        assert err["code"] == "invalid_image"
        assert err["type"] == "invalid_request_error"
        assert err["param"] == "messages[0].content[1]"
        assert r.headers["traceparent"]
    assert peer.accepted == 0


def test_an_embedding_of_the_wrong_width_is_500_and_never_goes_upstream(ckpt, peer):
    with (
        live_server(model=str(ckpt), llm_url=peer.url, encoder=TinyEncoder(embed_dim=16)) as live,
        live.client() as c,
    ):
        r = c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48)))
        assert r.status_code == 500
        err = _error(r)
        assert err["code"] == "embedding_mismatch"
        assert f"(4, {TEXT_HIDDEN})" in err["message"]
    assert peer.accepted == 0


def test_an_unreachable_llm_is_502_and_encode_keeps_serving(ckpt):
    with _server(ckpt, _dead_url()) as live, live.client() as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48), stream=stream))
            assert r.status_code == 502, r.text
            err = _error(r)
            assert err["code"] == "llm_unavailable"
            assert "--llm_url" in err["message"]
        r = c.get("/v1/models")
        assert r.status_code == 502
        assert _error(r)["code"] == "llm_unavailable"
        assert c.post("/encode", files={"images": ("a.png", png_bytes(64, 48))}).status_code == 200
        assert (
            live.metrics.value(
                "vitserve_upstream_requests_total", route="/v1/chat/completions", code="llm_unavailable"
            )
            == 2
        )


def test_a_silent_llm_is_504_after_llm_timeout_s(ckpt, peer):
    with _server(ckpt, peer.url, llm_timeout_s=1) as live, live.client() as c:
        for stream in (False, True):
            start = time.monotonic()
            r = c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48), stream=stream))
            assert r.status_code == 504, r.text
            assert _error(r)["code"] == "llm_timeout"
            assert "--llm_timeout_s" in _error(r)["message"]
            assert time.monotonic() - start < 10
    assert peer.accepted >= 1  # the request did go upstream; the LLM server never answered


def test_a_client_that_leaves_closes_the_upstream_connection(ckpt, peer):
    with _server(ckpt, peer.url, llm_timeout_s=60) as live:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live.url, timeout=1.5) as c:
            c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48)))
        # the client is gone: vitserve drops the upstream call, so the LLM server can abort the request
        assert peer.closed_by_client.wait(10)
        assert peer.accepted == 1


def test_api_key_errors_come_in_openai_shape_on_the_front_door(ckpt, peer):
    with _server(ckpt, peer.url, api_key="k") as live, live.client() as c:
        r = c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48)))
        assert r.status_code == 401
        assert _error(r)["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (
            c.post("/encode", json={"images": []}).json()["error"]["code"] == "unauthorized"
        )  # /encode's shape
        r = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": [{"type": "image_embeds"}]}]},
            headers={"authorization": "Bearer k"},
        )
        assert r.status_code == 400
        assert _error(r)["param"] is None
        assert "image_embeds" in _error(r)["message"]
    assert peer.accepted == 0


def test_without_llm_url_there_is_no_front_door(ckpt):
    with live_server(model=str(ckpt), encoder=TinyEncoder(embed_dim=TEXT_HIDDEN)) as live, live.client() as c:
        assert c.post("/v1/chat/completions", json=_chat(png_bytes(64, 48))).status_code == 404
        assert c.get("/v1/models").status_code == 404
        assert c.get("/v1/info").json()["llm_url"] is None
