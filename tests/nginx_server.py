"""A real nginx in front of several HTTP servers on loopback, for the tests of many vLLM engines behind a balancer
(issue 49; docs/vllm.md): `NginxServer(workdir, ["127.0.0.1:8001", "127.0.0.1:8002"]).start()`.

One upstream, round robin (nginx's default) over the backends, on a free 127.0.0.1 port. Everything of it lives
under `workdir`: its config, pid file, logs and temp paths (`nginx -p workdir -c nginx.conf -e error.log -g
'daemon off;'`), so no root config is read and nothing outside is written; one worker process, so the round robin
is exact. The request body is buffered (nginx's default): a request already sent to a backend that failed it can
be sent again only so. With `retry` (the default) a request that a backend refuses or fails (connection refused, reset, 502,
503) is sent to the next backend once (`proxy_next_upstream ... non_idempotent`, so POSTs too): the balancer retry
of issue 49. The access log records, per request, every upstream it tried (`upstreams()`).

The binary: $VITSERVE_TEST_NGINX, else `nginx` on PATH, else /usr/sbin/nginx; `bash scripts/nginx.sh` installs
Debian's nginx-light. Without one the tests skip, except in CI (CI=true), where they fail: there they must run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.ports import unused_port

START_TIMEOUT_S = 30
READY_PATH = "/nginx-ready"  # answered by nginx itself, never by a backend

CONFIG = """\
{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format upstreams '$request_method $uri $status upstream=[$upstream_addr] statuses=[$upstream_status]';
    access_log {prefix}/access.log upstreams;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    client_max_body_size {max_body};
    upstream backends {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location = {ready} {{ return 200 "nginx\\n"; }}
        location / {{
            proxy_pass http://backends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_connect_timeout 2s;
            proxy_read_timeout {read_timeout};
            proxy_send_timeout {read_timeout};
{retry}
        }}
    }}
}}
"""
RETRY = """\
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries {tries};"""
NO_RETRY = "            proxy_next_upstream off;"


def nginx_binary() -> str:
    """The nginx to run; skips (fails in CI) when there is none."""
    for candidate in (os.environ.get("VITSERVE_TEST_NGINX"), shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    message = "no nginx ($VITSERVE_TEST_NGINX, PATH, /usr/sbin/nginx): run `bash scripts/nginx.sh`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (in CI the balancer tests must run, not skip)")
    pytest.skip(message)


class NginxServer:
    def __init__(
        self,
        workdir: Path,
        backends: Sequence[str],
        *,
        retry: bool = True,
        read_timeout_s: int = 600,
        max_body: str = "256m",  # a chat request with raw images inline (vLLM alone, the comparison) is large
    ) -> None:
        if not backends:
            raise ValueError("nginx needs at least one backend (host:port)")
        self.workdir = Path(workdir)
        self.backends = list(backends)
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        # max_fails=0: a backend that failed once is still tried next time (a restarted engine is used at once);
        # each request's own retry is proxy_next_upstream's
        servers = "\n".join(f"        server {b} max_fails=0;" for b in self.backends)
        # as root nginx's workers would run as `nobody`, who may not write this tmp dir: they stay its owner
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        config = CONFIG.format(
            user=user,
            prefix=self.workdir,
            max_body=max_body,
            servers=servers,
            port=self.port,
            ready=READY_PATH,
            read_timeout=f"{read_timeout_s}s",
            retry=RETRY.format(tries=len(self.backends)) if retry else NO_RETRY,
        )
        self.config_path = self.workdir / "nginx.conf"
        self.config_path.write_text(config)

    def argv(self) -> list[str]:
        prefix = str(self.workdir)
        return [nginx_binary(), "-p", prefix, "-c", str(self.config_path), "-e", f"{prefix}/error.log"]

    def start(self) -> NginxServer:
        argv = self.argv()
        check = subprocess.run([*argv, "-t"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"nginx refused its config {self.config_path}:\n{check.stderr}")
        with open(self.workdir / "stdout.log", "ab") as out:
            self.proc = subprocess.Popen(
                [*argv, "-g", "daemon off;"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        end = time.monotonic() + START_TIMEOUT_S
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"nginx did not start:\n{self.error_log()}")
            time.sleep(0.02)
        return self

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + READY_PATH, timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def upstreams(self) -> list[list[str]]:
        """Per proxied request in the access log, the upstreams nginx tried, in order (the last one answered)."""
        path = self.workdir / "access.log"
        lines = path.read_text().splitlines() if path.exists() else []
        tried = []
        for line in lines:
            if " upstream=[" in line and not line.split(" upstream=[", 1)[1].startswith("-]"):
                addresses = line.split(" upstream=[", 1)[1].split("]", 1)[0]
                tried.append([a.strip() for a in addresses.replace(" : ", ", ").split(",")])
        return tried

    def error_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "error.log").read_text(errors="replace")[-4000:]
        return ""

    def stop(self) -> None:
        """SIGQUIT (graceful: requests in progress finish), SIGKILL to the group after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def nginx_server(workdir: Path, backends: Sequence[str], **kwargs: object) -> Iterator[NginxServer]:
    server = NginxServer(workdir, backends, **kwargs).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
