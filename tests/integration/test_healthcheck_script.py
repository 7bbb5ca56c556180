"""docker/healthcheck.py, the images' HEALTHCHECK, run as Docker runs it (a process of its own) against a
real HTTP server: it passes only when /ready answers 200, and it sends the API key."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

from tests.cli import ROOT


class _ReadyHandler(http.server.BaseHTTPRequestHandler):
    status = 503
    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_script_passes_only_when_ready_answers_200():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ReadyHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"VITSERVE_PORT": str(server.server_port), "VITSERVE_API_KEY": "k1"}

    def check() -> int:
        script = ROOT / "docker" / "healthcheck.py"
        return subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=30).returncode

    try:
        _ReadyHandler.status = 503
        assert check() == 1
        _ReadyHandler.status = 200
        assert check() == 0
    finally:
        server.shutdown()
    assert _ReadyHandler.seen == [("/ready", "Bearer k1")] * 2
    env["VITSERVE_PORT"] = str(server.server_port)  # now closed: nothing listens
    assert check() == 1
