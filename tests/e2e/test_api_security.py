"""Closed by default (docs/design.md invariant 15): loopback only, the API key on every route but /health, URL
inputs that cannot reach inside."""

from __future__ import annotations

import base64
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.e2e.live import live_server, png_bytes
from tests.e2e.netcheck import listening_sockets
from vitserve.api import urls
from vitserve.api.edge import PROBE_PATHS

pytestmark = pytest.mark.timeout(120)
LOOPBACK = {"127.0.0.1", "::1"}


def test_listening_sockets_are_loopback_only():
    with live_server() as srv:
        found = listening_sockets([os.getpid()])
        assert ("127.0.0.1", srv.service.port) in found
        assert {addr for addr, _ in found} <= LOOPBACK, found


# -- the API key --------------------------------------------------------------------------------------------
ROUTES = [
    ("GET", "/ready"),
    ("GET", "/v1/info"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("POST", "/encode"),
    ("GET", "/does-not-exist"),
]


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", "Bearer s3cret-but-longer", "s3cret", "Basic czNjcmV0"]
)
def test_every_route_but_health_needs_the_key(auth):
    with live_server(api_key="s3cret") as srv, srv.client() as c:
        headers = {"Authorization": auth} if auth else {}
        for method, path in ROUTES:
            r = c.request(method, path, headers=headers, json={"images": []})
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/health", headers=headers).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert c.get("/ready", headers=good).status_code == 200
        assert c.get("/openapi.json", headers=good).status_code == 200
        img = base64.b64encode(png_bytes(30, 30)).decode()
        assert c.post("/encode", headers=good, json={"images": [{"b64": img}]}).status_code == 200
        probes = [path for _, path in ROUTES if path in PROBE_PATHS]  # counted apart from requests
        assert srv.metrics.value("vitserve_requests_total", code="401") == len(ROUTES) - len(probes)
        for path in probes:
            assert srv.metrics.value("vitserve_probes_total", path=path, code="401") == 1


# -- URL inputs ---------------------------------------------------------------------------------------------
class Decoy:
    """An HTTP server on loopback that records every connection it accepts."""

    def __init__(self, handler=None):
        decoy = self
        self.connections = 0
        self.hosts: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def setup(self):
                decoy.connections += 1
                super().setup()

            def do_GET(self):
                decoy.hosts.append(self.headers.get("Host", ""))
                (handler or Decoy.serve_png)(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def serve_png(h):
        body = png_bytes(40, 40)
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def decoy():
    d = Decoy()
    yield d
    d.close()


ALLOWED = (
    "localhost",
    "127.0.0.1",
    "::1",
    "169.254.169.254",
    "10.0.0.1",
    "::ffff:127.0.0.1",
    "redirector.test",
    "pinned.test",
)


def url_request(c, url: str):
    return c.post(
        "/encode", json={"images": [{"b64": base64.b64encode(png_bytes(8, 8)).decode()}, {"url": url}]}
    )


def test_urls_are_refused_when_disabled(decoy):
    with live_server() as srv, srv.client() as c:
        r = url_request(c, f"http://localhost:{decoy.port}/a.png")
        assert r.status_code == 400
        assert r.json()["error"] == {
            "code": "url_not_allowed",
            "image_index": 1,
            "message": r.json()["error"]["message"],
        }
        assert "--allow_image_urls" in r.json()["error"]["message"]
    assert decoy.connections == 0


def test_internal_targets_are_refused_before_connecting(decoy):
    p = decoy.port
    targets = [
        f"http://127.0.0.1:{p}/a.png",
        f"http://[::1]:{p}/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/a.png",
        f"http://[::ffff:127.0.0.1]:{p}/a.png",
        f"http://localhost:{p}/a.png",
        f"https://localhost:{p}/a.png",
        "file:///etc/passwd",
        f"ftp://localhost:{p}/a.png",
        f"http://evil.example:{p}/a.png",
        f"http://user:pw@localhost:{p}/a.png",
    ]
    with live_server(allow_image_urls=True, allowed_url_domains=ALLOWED) as srv, srv.client() as c:
        for url in targets:
            r = url_request(c, url)
            assert r.status_code == 400, (url, r.text)
            assert r.json()["error"]["code"] == "url_not_allowed", url
            assert r.json()["error"]["image_index"] == 1
        assert (
            srv.metrics.value("vitserve_batch_images_count") == 0
        )  # all-or-nothing: image 0 never reached it
    assert decoy.connections == 0


def _pretend_public(monkeypatch, names: set[str]):
    """Make `names` resolve to 127.0.0.1 AND count as public, as a real public host would (stands in for DNS)."""
    real = urls.resolve_public

    async def fake(host, port, timeout_s):
        if host in names:
            return urls.ipaddress.ip_address("127.0.0.1")
        return await real(host, port, timeout_s)

    monkeypatch.setattr(urls, "resolve_public", fake)


def test_redirect_to_loopback_is_refused_and_not_followed(decoy, monkeypatch):
    def redirect(h):
        h.send_response(302)
        h.send_header("Location", f"http://127.0.0.1:{decoy.port}/a.png")
        h.send_header("Content-Length", "0")
        h.end_headers()

    redirector = Decoy(redirect)
    _pretend_public(monkeypatch, {"redirector.test"})
    try:
        with live_server(allow_image_urls=True, allowed_url_domains=ALLOWED) as srv, srv.client() as c:
            r = url_request(c, f"http://redirector.test:{redirector.port}/a.png")
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "url_not_allowed"
            assert "redirect" in r.json()["error"]["message"]
        assert redirector.connections == 1
        assert decoy.connections == 0
    finally:
        redirector.close()


def test_fetch_connects_to_the_checked_address_without_a_second_lookup(decoy, monkeypatch):
    # Any name lookup of "pinned.test" after the check fails loudly (and is recorded): the fetch can only
    # succeed by connecting to the address that was checked.
    lookups: list = []
    real_getaddrinfo = socket.getaddrinfo

    def guarded(host, *args, **kw):
        if isinstance(host, str) and host.startswith("pinned"):
            lookups.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "no lookups of pinned.test allowed")
        return real_getaddrinfo(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    _pretend_public(monkeypatch, {"pinned.test"})
    with live_server(allow_image_urls=True, allowed_url_domains=ALLOWED) as srv, srv.client() as c:
        r = url_request(c, f"http://pinned.test:{decoy.port}/a.png")
        assert r.status_code == 200, r.text
        assert r.json()["images"][1]["original_size"] == [40, 40]
    assert decoy.hosts == [f"pinned.test:{decoy.port}"]
    assert lookups == []


def test_url_body_over_cap_is_413(monkeypatch):
    def big(h):
        h.send_response(200)
        h.end_headers()  # no Content-Length: counted while streaming
        h.wfile.write(b"\0" * 200_000)

    server = Decoy(big)
    _pretend_public(monkeypatch, {"pinned.test"})
    try:
        with (
            live_server(allow_image_urls=True, allowed_url_domains=ALLOWED, max_request_bytes=100_000) as srv,
            srv.client() as c,
        ):
            r = url_request(c, f"http://pinned.test:{server.port}/big")
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "payload_too_large"
    finally:
        server.close()
