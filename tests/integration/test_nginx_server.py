"""The real nginx that the balancer tests put in front of several vLLMs (tests/nginx_server.py): round robin reaches
every backend, and a request that a backend cannot take (down, or answering 502) is sent to the other one, POSTs
included: the balancer retry of issue 49. Two tiny HTTP servers on threads are the backends. And the balancer of
deploy/compose.pull.yaml is a config nginx accepts."""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.nginx_server import nginx_binary, nginx_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


class Backend:
    """An HTTP server that answers with its name (or with `status`) and counts what it got."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status = name, status
        self.hits: collections.Counter[str] = collections.Counter()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                backend.hits[self.command] += 1
                reply = f"{backend.name} {len(body)}".encode()
                self.send_response(backend.status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop and free the port: nginx's connections to it are refused from now on."""
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def backends(*specs: tuple[str, int]) -> Iterator[list[Backend]]:
    made = [Backend(name, status) for name, status in specs]
    try:
        yield made
    finally:
        for b in made:
            with contextlib.suppress(OSError):
                b.close()


def post(url: str, i: int) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=b"x" * i, timeout=30, trust_env=False)


def test_round_robin_reaches_both_backends_in_turn(tmp_path):
    with backends(("a", 200), ("b", 200)) as (a, b), nginx_server(tmp_path, [a.address, b.address]) as nginx:
        names = [post(nginx.url, i).text.split()[0] for i in range(6)]
        assert httpx.get(nginx.url + "/health", trust_env=False).status_code == 200
        assert sorted(names) == ["a", "a", "a", "b", "b", "b"], names
        assert names[0] != names[1], "in turn, one worker process"
        assert a.hits["POST"] == b.hits["POST"] == 3
        assert len(nginx.upstreams()) == 7, "the access log names the upstream of each request"


@pytest.mark.parametrize("down", ["closed", "502"])
def test_a_request_the_one_backend_cannot_take_goes_to_the_other(tmp_path, down):
    status = 502 if down == "502" else 200
    with backends(("a", 200), ("b", status)) as (a, b):
        if down == "closed":
            b.close()
        with nginx_server(tmp_path, [a.address, b.address]) as nginx:
            answers = [post(nginx.url, i) for i in range(4)]
            tried = nginx.upstreams()
    assert [r.status_code for r in answers] == [200] * 4
    assert {r.text.split()[0] for r in answers} == {"a"}
    assert a.hits["POST"] == 4
    retried = [t for t in tried if len(t) == 2]
    assert retried, f"some request was sent to b first and then to a: {tried}"
    assert all(t == [b.address, a.address] for t in retried)
    if down == "502":
        assert b.hits["POST"] == len(retried), "b took them and failed: each went on to a"


def test_without_retry_a_failing_backend_fails_the_request(tmp_path):
    with (
        backends(("a", 200), ("b", 502)) as (a, b),
        nginx_server(tmp_path, [a.address, b.address], retry=False) as nginx,
    ):
        statuses = sorted(post(nginx.url, i).status_code for i in range(4))
    assert statuses == [200, 200, 502, 502], (
        "the retry above is nginx's, configured: not a property of the test"
    )


def test_the_deploy_config_is_one_nginx_accepts(tmp_path):
    """deploy/nginx.pull.conf (deploy/compose.pull.yaml's balancer) passes `nginx -t`: its service names become
    loopback (nothing resolves them here) and its temp paths go under tmp_path; nothing else changes."""
    text = (ROOT / "deploy" / "nginx.pull.conf").read_text()
    text = re.sub(r"server vllm-\d+:", "server 127.0.0.1:", text)
    temps = "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in TEMP_KINDS)
    text = text.replace("http {\n", "http {\n" + temps, 1)
    (tmp_path / "nginx.conf").write_text(text)
    argv = [nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")]
    argv += ["-e", str(tmp_path / "error.log"), "-g", f"pid {tmp_path}/nginx.pid;"]
    check = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
