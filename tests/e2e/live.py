"""A real vitserve Service (uvicorn + engine) on an ephemeral 127.0.0.1 port, in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from PIL import Image

from tests.fakes import thread_engine
from vitserve.api.server import Service, bind_socket
from vitserve.config import Config
from vitserve.engine import Engine
from vitserve.metrics import Metrics
from vitserve.processors import load_image_processor

TEST_CONFIG = Config(port=0, visual_batch_max_tokens=256, request_timeout_s=30)
START_LIMIT_S = 300  # a real engine's ranks on a loaded 2-core machine; a failed start is seen at once


@dataclass
class Live:
    url: str
    service: Service
    engine: Engine
    metrics: Metrics
    config: Config
    result: dict
    gate: (
        threading.Event
    )  # cleared: the in-process encoder group holds every batch (no effect on make_engine)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)


@contextlib.contextmanager
def live_server(
    config: Config | None = None, *, engine=None, processor=None, make_engine=None, encoder=None, **overrides
):
    """The Service over `engine`, else make_engine(config, metrics) (e.g. the real Engine with spawned ranks),
    else the real Engine over one in-process ThreadGroup running `encoder` (default tests.fakes.TinyEncoder)."""
    config = replace(config or TEST_CONFIG, **overrides)
    metrics = Metrics()
    processor = processor or load_image_processor(
        "qwen2_5_vl" if config.model == "demo" else config.model,
        budget_tokens=config.visual_batch_max_tokens,
        resize=config.image_resize,
    )
    gate = threading.Event()
    gate.set()
    if engine is None:
        engine = (
            make_engine(config, metrics)
            if make_engine
            else thread_engine(config, metrics, gate=gate, encoder=encoder)
        )
    service = Service(config, engine, lambda _config: processor, metrics, sock=bind_socket("127.0.0.1", 0))
    with serving(service) as result:
        try:
            yield Live(f"http://127.0.0.1:{service.port}", service, engine, metrics, config, result, gate)
        finally:
            gate.set()


@contextlib.contextmanager
def serving(service: Service):
    """Run `service` in a background thread until the block ends (then what SIGTERM does, and the thread
    joined); yields the dict that gets its exit "code" (or the "error" it raised)."""
    result: dict = {}

    def run() -> None:
        try:
            result["code"] = asyncio.run(service.run())
        except BaseException as exc:  # seen by _wait_started, which raises it in the test
            result["error"] = exc
            raise

    thread = threading.Thread(target=run, name="live-server", daemon=True)
    thread.start()
    _wait_started(service, thread, result)
    try:
        yield result
    finally:
        service.request_stop()
        thread.join(60)


def _wait_started(service: Service, thread: threading.Thread, result: dict) -> None:
    """Until the service is serving; at once when its thread has ended instead (a start-up that failed
    returns an exit code or raises: waiting START_LIMIT_S for it would only delay the failure)."""
    end = time.monotonic() + START_LIMIT_S
    while not service.started.wait(0.05):
        if not thread.is_alive():
            raise RuntimeError(f"the server ended during start-up: {result}") from result.get("error")
        if time.monotonic() > end:
            raise RuntimeError(f"server did not start within {START_LIMIT_S} s: {result}")


def png_bytes(width: int, height: int, color=(200, 30, 60), mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, format=fmt)
    return buf.getvalue()


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    import numpy as np

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def real_engine_options(tmp_dir) -> dict:
    """live_server(**...) overrides for the REAL Engine: spawned workers over a tiny real Qwen2.5-VL checkpoint."""
    from tests.checkpoints import make_checkpoint
    from vitserve.engine import Engine

    checkpoint = make_checkpoint("qwen2_5_vl", tmp_dir / "ckpt")
    return {
        "model": str(checkpoint),
        "make_engine": Engine,
        "heartbeat_s": 2.0,
        "dist_timeout_s": 60.0,
        "device": "cpu",
        "runtime_dir": str(tmp_dir / "rt"),
    }


def wait_until(predicate, what: str, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


@dataclass
class InProcess:
    url: str  # as tests.cli.Cli's, so a test reads either the same way


@contextlib.contextmanager
def cli_in_process(argv: list[str], tmp_path):
    """What `vitserve ARGV` serves (vitserve.cli's build_config, preflight and build_service; the ranks forked
    from the session's forkserver), run from a thread of this process with its runtime dir under tmp_path:
    ~1 s where starting the CLI costs 7-13 s of imports on 2 cores. For tests whose subject is what the service
    does with its flags, not the process (tests/cli.py runs that). The block must end with the service
    stopping with exit 0."""
    service = _cli_service(argv, tmp_path)
    with serving(service) as result:
        yield InProcess(f"http://127.0.0.1:{service.port}")
    assert result.get("code") == 0, result


def cli_exit_in_process(argv: list[str], tmp_path) -> int:
    """The exit code of `vitserve ARGV` for a start-up that ends by itself (e.g. a memory target no budget
    fits: 2), its service run as cli_in_process runs it; what it prints goes to this process's stderr."""
    return run_to_exit(_cli_service(argv, tmp_path))


def run_to_exit(service: Service) -> int:
    """`service.run()`'s exit code, run in a thread (so pytest's own signal handlers stay as they are) until
    it returns by itself."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=asyncio.run(service.run())), daemon=True)
    thread.start()
    thread.join(START_LIMIT_S)
    assert "code" in result, f"the service did not exit within {START_LIMIT_S} s"
    return result["code"]


def _cli_service(argv: list[str], tmp_path) -> Service:
    from vitserve import cli, preflight
    from vitserve.flags import build_config

    config = build_config(argv, {"VITSERVE_RUNTIME_DIR": str(Path(tmp_path) / "rt")})
    return cli.build_service(config, preflight.check(config))
