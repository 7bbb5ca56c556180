"""Shared helpers for the engine/pool/fault integration tests (real spawned ranks, gloo on CPU)."""

from __future__ import annotations

import contextlib
import os
import time

from tests.fakes import FakeEncoderFactory
from vitserve.config import Config
from vitserve.contract import EncodeRequest, PreparedImage, ProcessedImage
from vitserve.engine import Engine
from vitserve.metrics import Metrics


def make_config(tmp_path, **overrides) -> Config:
    base = {
        "visual_batch_max_tokens": 64,
        "visual_infer_batch_size": 8,
        "heartbeat_s": 1.0,
        "dist_timeout_s": 10.0,
        "max_queue_tokens": 1_000_000,
        "request_timeout_s": 30.0,
        "runtime_dir": str(tmp_path / "runtime"),
        "device": "cpu",
    }
    return Config(**{**base, **overrides})


@contextlib.asynccontextmanager
async def running_engine(config: Config, factory: FakeEncoderFactory | None = FakeEncoderFactory()):  # noqa: B008
    # factory=None in a call means the production encoder; the default argument means the fake
    engine = Engine(config, Metrics(), encoder_factory=factory, environ={})
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()  # a second call is a no-op
        assert_gone(all_pids(engine))


def all_pids(engine: Engine) -> list[int]:
    return [pid for pids in engine.worker_pids().values() for pid in pids]


def pid_running(pid: int) -> bool:
    """True while the process exists and is not a zombie (read from /proc, no psutil)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def assert_gone(pids: list[int], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end and any(pid_running(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if pid_running(p)]
    assert not alive, f"orphan worker processes: {alive}"


def deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def kill_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def encode(
    engine: Engine,
    request_id: str,
    items: list[ProcessedImage],
    image_ids: list[str],
    *,
    deadline: float,
    return_embeddings: bool,
):
    """engine.encode with the request built from plain items (the API builds it from decoded uploads)."""
    images = tuple(
        PreparedImage(item, image_id, item.resized_size, 0.0, 0.0)
        for item, image_id in zip(items, image_ids, strict=True)
    )
    return engine.encode(EncodeRequest(request_id, images, deadline, return_embeddings))
