"""The warm-up encode: a group is ready only after one real image went through the production path
(batch socket -> rank loop -> forward -> RESULT) and came back well formed; it stays out of the metrics.
And a start cancelled before that (SIGTERM during start-up) cleans up after itself."""

from __future__ import annotations

import asyncio
import functools
import os
import threading

import pytest
import torch

from tests.fakes import FakeEncoderFactory, ThreadGroup, TinyEncoder, batch_hash, fake_item
from tests.integration.engine_helpers import all_pids, assert_gone, make_config
from vitserve.contract import EncodedImage, Readiness
from vitserve.engine import Engine
from vitserve.errors import ConfigError
from vitserve.metrics import Metrics
from vitserve.worker.reservation.published import publish_reservation

pytestmark = pytest.mark.timeout(240)
WARMUP = fake_item(2, 2, seed=9)


async def _start_watching(engine: Engine) -> list[str]:
    """Start the engine; return every distinct readiness reason seen while it started."""
    starting = asyncio.create_task(engine.start())
    reasons: list[str] = []
    while not starting.done():
        readiness = engine.readiness()
        assert not readiness.ready
        if readiness.reason not in reasons:
            reasons.append(readiness.reason)
        await asyncio.sleep(0.02)
    await starting
    return reasons


@pytest.mark.parametrize("tp", [1, 2])
async def test_every_rank_encodes_the_warmup_image_before_ready(tmp_path, tp):
    logs = tmp_path / "hashes"
    logs.mkdir()
    config = make_config(tmp_path, tp=tp)
    # logs (and slows) each batch after the stress: the first is the warm-up
    factory = FakeEncoderFactory(hash_log_dir=str(logs), sleep_s=1.0)
    metrics = Metrics()
    engine = Engine(config, metrics, encoder_factory=factory, environ={}, warmup_image=WARMUP)
    try:
        reasons = await _start_watching(engine)
        assert "encoder ranks are up; running the warm-up encode" in reasons
        assert engine.readiness() == Readiness(True, "ok")
        assert [g["state"] for g in engine.groups()] == ["ready"]
        files = sorted(logs.iterdir())
        assert len(files) == tp  # every rank of the group ran it
        for file in files:
            assert file.read_text().split() == [batch_hash([WARMUP])]
        assert metrics.value("vitserve_workers_ready") == tp
        for name in ("vitserve_images_total", "vitserve_batch_images_count"):  # no request asked for it
            assert not metrics.value(name, **({"outcome": "encoded"} if "images" in name else {}))
    finally:
        await engine.shutdown()
    assert_gone(all_pids(engine))


async def test_a_warmup_that_fails_in_the_rank_fails_startup(tmp_path):
    config = make_config(tmp_path)
    engine = Engine(
        config,
        Metrics(),
        encoder_factory=FakeEncoderFactory(raise_on_rank=0),
        environ={},
        warmup_image=WARMUP,
    )
    with pytest.raises(ConfigError, match=r"encoder start-up failed: .*injected failure on rank 0"):
        await engine.start()
    assert engine.readiness().ready is False
    assert_gone(all_pids(engine))


class _Broken(TinyEncoder):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def encode(self, items):
        out = super().encode(items)
        if self.how == "nan":
            return [EncodedImage(embedding=torch.full_like(o.embedding, float("nan"))) for o in out]
        return [EncodedImage(embedding=o.embedding[:-1]) for o in out]  # one token short


@pytest.mark.parametrize(
    ("how", "message"),
    [("nan", "returned NaN or infinite values"), ("short", r"returned \(3, 16\), expected \(4, 16\)")],
)
async def test_a_malformed_warmup_result_fails_startup(tmp_path, how, message):
    gate = threading.Event()
    gate.set()
    item = fake_item(2, 2, seed=1)
    item.pixel_values = torch.randn(16, 3 * 2 * 14 * 14)  # TinyEncoder's patch rows: 4 per token
    encoder = _Broken(how)
    engine = Engine(
        make_config(tmp_path),
        Metrics(),
        encoder_factory=lambda _config: encoder,
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
        warmup_image=item,
    )
    with pytest.raises(ConfigError, match=rf"the warm-up encode of group 0 {message}"):
        await engine.start()
    await engine.shutdown()


async def test_a_readiness_check_can_hold_ready(tmp_path):
    gate = threading.Event()
    gate.set()
    engine = Engine(
        make_config(tmp_path),
        Metrics(),
        encoder_factory=lambda _config: TinyEncoder(),
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
    )
    down: list[str] = ["the LLM receiver is not reachable"]
    engine.readiness_checks.append(lambda: down[0] if down else None)
    await engine.start()
    try:
        assert engine.readiness() == Readiness(False, "the LLM receiver is not reachable")
        down.clear()
        assert engine.readiness() == Readiness(True, "ok")
    finally:
        await engine.shutdown()


async def test_a_cancelled_start_removes_only_its_own_reservation_files(tmp_path):
    """A rank publishes its file just before its READY: a start cancelled in between (SIGTERM during
    start-up) must still remove it, and must leave another process's file alone."""
    gate, loading = threading.Event(), threading.Event()
    gate.set()
    config = make_config(tmp_path)

    def slow_factory(_config):  # the rank is still loading: no READY yet
        loading.wait(30)
        return TinyEncoder()

    engine = Engine(
        config,
        Metrics(),
        encoder_factory=slow_factory,
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
    )
    ours = publish_reservation(config.runtime_dir, "cpu", 0, 123, "stress")  # this process = the thread rank
    theirs = publish_reservation(config.runtime_dir, "cuda", 0, 456, "stress")
    theirs.write_text(theirs.read_text().replace(f'"pid": {os.getpid()}', '"pid": 1'))
    starting = asyncio.create_task(engine.start())
    await asyncio.sleep(0.2)
    assert not starting.done()
    starting.cancel()
    loading.set()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not ours.exists()
    assert theirs.exists()
