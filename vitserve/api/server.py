"""Running the app: uvicorn on a socket we bound, the engine started beside it, SIGTERM -> stop or drain.

A stop request (SIGTERM, SIGINT or `request_stop`) is watched from the first line of `run()`:
- while the engine starts, it cancels the start (Engine.start tears down what it spawned: the ranks get
  SIGTERM, then SIGKILL after a short grace; their reservation files and the ipc dir are removed) and
  `run()` returns 128 + the signal number (143 for SIGTERM, 130 for SIGINT; 0 for `request_stop`);
- while serving, it drains (below) and `run()` returns 0. A second signal during the drain stops waiting
  for the active requests.

Drain order (Service._drain, the only drain): the edge refuses /encode and /ready (503 not_ready), every
active request finishes, the engine stops its groups, then the HTTP server closes. uvicorn's own signal capture is disabled: it
would close the listening socket first and re-raise the signal afterwards, turning a clean drain into a
death by SIGTERM (exit -15).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI
from PIL import Image
from starlette.types import ASGIApp, Receive, Scope, Send

from vitserve.api.app import close_app, create_app
from vitserve.api.edge import ServerState
from vitserve.api.listen import bind_socket
from vitserve.api.starting import starting_app
from vitserve.config import Config
from vitserve.contract import Engine, ProcessedImage
from vitserve.errors import ConfigError, MemoryTargetError, VitserveError
from vitserve.metrics import Metrics
from vitserve.processors.base import VisionProcessor

log = logging.getLogger("vitserve")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the Service owns SIGTERM/SIGINT
        yield


def http_server(app: ASGIApp, log_level: str) -> _Server:
    """uvicorn as vitserve runs it, on sockets the caller binds (`serve(sockets=[bind_socket(...)])`).

    HTTP parsing by httptools, uvicorn's C parser (a dependency): 0.15-0.5 ms less per request than h11 in
    bench/latency.py, 2.5 ms less at load 7 in a bare echo test. "auto" is uvicorn's choice of httptools when
    it is importable, so an environment installed before the dependency still serves, on h11."""
    ucfg = uvicorn.Config(
        app,
        http="auto",
        log_config=None,
        lifespan="off",
        access_log=False,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return _Server(ucfg)


def warmup_image(processor: VisionProcessor) -> ProcessedImage:
    """What every encoder group encodes once before /ready says ready (Engine's warmup_image): a 64x64
    gradient, the family's smallest image (Qwen grows it to min_pixels, InternVL makes one tile),
    preprocessed like a request's image."""
    return processor.preprocess(Image.linear_gradient("L").resize((64, 64)).convert("RGB"))


class _AppSwitch:
    """The ASGI app uvicorn serves: the start-up app (api/starting.py) until the engine's start has decided
    the Config, then the app the Service built from it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class Service:
    """One vitserve process: HTTP front door + engine. `run()` returns the process exit code."""

    def __init__(
        self,
        config: Config,
        engine: Engine,
        processor_for: Callable[[Config], VisionProcessor],
        metrics: Metrics,
        *,
        sock: socket.socket | None = None,
        banner: Callable[[Service], str] | None = None,
    ):
        """processor_for: the image processor for the Config to serve with (the CLI's loader). The processor
        and the app are built once, in run(), from the Config the engine's start returned: the flags' own, or
        with --visual_mem_gb alone the flags' with the budget the ranks chose."""
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.state = ServerState()
        self._processor_for = processor_for
        self.processor: VisionProcessor | None = None
        self.app: FastAPI | None = None
        self._switch = _AppSwitch(starting_app(config, engine, metrics, self.state))
        self.sock = sock or bind_socket(config.host, config.port)
        self.port: int = self.sock.getsockname()[1]  # the real one when --port 0
        self.banner = banner
        self._stop: asyncio.Event | None = None
        self._signum: int | None = None  # the signal that asked to stop, if one did
        self._hurry = False  # a second stop request: the drain no longer waits for active requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Event()

    def _open_front(self, config: Config) -> None:
        """The image processor and the app, built once, from the Config the engine's start decided."""
        self.config = config
        self.processor = self._processor_for(config)
        self.app = create_app(config, self.engine, self.processor, self.metrics, state=self.state)
        self._switch.app = self.app

    async def _close_front(self) -> None:
        if self.app is not None:
            await close_app(self.app)

    def request_stop(self) -> None:
        """Thread-safe: what SIGTERM does."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._install_signals()
        server = http_server(self._switch, self.config.log_level)
        serving = asyncio.create_task(server.serve(sockets=[self.sock]))
        decided = await self._start_engine()
        if not isinstance(decided, Config):  # the exit code
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await serving
            return decided
        if (code := await self._open_front_after_start(decided)) is not None:
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await serving
            return code
        if self.banner is not None:  # printed whatever --log_level says: it is the record of every guard
            print(self.banner(self), file=sys.stderr, flush=True)
        self.started.set()
        return await self._serve_until_stopped(server, serving)

    async def _start_engine(self) -> Config | int:
        """Start the engine unless a stop request comes first. The Config it decided once it is ready, else
        the exit code: 1 when start-up failed, 2 when --visual_mem_gb cannot be met, 128 + the signal number
        when a signal stopped it (0 for request_stop)."""
        assert self._stop is not None
        starting = asyncio.create_task(self.engine.start(), name="vitserve-engine-start")
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not starting.done():  # Engine.start tears down what it spawned when cancelled
            starting.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await starting
            await self.engine.shutdown()  # marks the engine stopping; nothing is left to stop
            by = signal.Signals(self._signum).name if self._signum is not None else "request"
            log.info("stopped by %s during start-up; the encoder ranks are gone", by)
            return 128 + self._signum if self._signum is not None else 0
        try:
            decided = starting.result()
        except MemoryTargetError as exc:  # a setting that can never work: one line, exit 2 (docs/api.md)
            print(f"vitserve: start-up failed: {exc}", file=sys.stderr, flush=True)
            return 2
        except Exception as exc:  # start-up failed: the engine's message names the knob
            log.error("start-up failed: %s", exc)
            return 1
        return decided  # a stop that came with READY is seen by _serve_until_stopped: it drains at once

    async def _open_front_after_start(self, decided: Config) -> int | None:
        """Build the processor and the app (_open_front); None once they serve, else the exit code: 2 for a
        setting they refuse (one line, as the CLI's checks before the ranks print it), 1 for anything else.
        The engine is stopped first: its ranks are running by now."""
        try:
            self._open_front(decided)
        except (ConfigError, VitserveError, OSError) as exc:
            print(f"vitserve: start-up failed: {exc}", file=sys.stderr, flush=True)
            code = 2
        except Exception as exc:
            log.exception("start-up failed: %s", exc)
            code = 1
        else:
            return None
        await self.engine.shutdown()
        return code

    async def _serve_until_stopped(self, server: _Server, serving: asyncio.Task[None]) -> int:
        assert self._stop is not None
        stop = asyncio.create_task(self._stop.wait())
        dead = asyncio.create_task(self._watch_engine())
        done, _ = await asyncio.wait({serving, stop, dead}, return_when=asyncio.FIRST_COMPLETED)
        code = 1 if (dead in done or serving in done) else 0
        if dead in done:
            log.error("every encoder worker group is dead and none could be replaced; exiting")
        await self._drain(graceful=code == 0)
        server.should_exit = True
        for task in (stop, dead):
            task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await serving
        return code

    async def _drain(self, *, graceful: bool) -> None:
        """The one drain sequence: the edge refuses new work and /ready, the requests being served finish
        (each bounded by its deadline), then the engine stops its groups."""
        self.state.draining = True
        log.info("draining: refusing new requests, finishing %d active", self.state.active_requests)
        give_up = time.monotonic() + self.config.request_timeout_s + 5
        if (
            self.config.llm_url is not None
        ):  # a chat completion: its images, then up to --llm_timeout_s upstream
            give_up += self.config.llm_timeout_s
        while graceful and not self._hurry and self.state.active_requests and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        try:
            await self.engine.shutdown()
        except Exception as exc:
            log.error("engine shutdown failed: %s", exc)
        await self._close_front()

    async def _watch_engine(self) -> None:
        """Returns when the engine says no encoder group is left (engine.failed, an asyncio.Event)."""
        await self.engine.failed.wait()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        assert self._loop is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        assert self._stop is not None
        if self._stop.is_set():
            log.info("received %s again: not waiting for the active requests", signal.Signals(sig).name)
            self._hurry = True
            return
        log.info("received %s: shutting down cleanly", signal.Signals(sig).name)
        self._signum = sig
        self._stop.set()
