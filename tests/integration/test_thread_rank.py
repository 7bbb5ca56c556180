"""tests/fakes.py ThreadGroup runs the real rank (vitserve/worker/rank.py RankWorker) in a thread of the test
process, so every end-to-end test over it runs the production rank loop, not a copy of it."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import pytest
import torch

from tests.fakes import ThreadGroup, TinyEncoder, fake_item
from tests.integration.engine_helpers import deadline, encode, make_config
from vitserve.contract import Readiness
from vitserve.engine import Engine
from vitserve.metrics import Metrics

pytestmark = pytest.mark.timeout(120)


async def test_the_thread_rank_reserves_reports_serves_and_stops_like_a_rank(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    gate = threading.Event()  # cleared: the first forward is held
    metrics = Metrics()
    config = make_config(tmp_path, visual_reserved_mem_gb=0.25)  # heartbeat_s 1.0
    encoder = TinyEncoder()
    engine = Engine(
        config,
        metrics,
        encoder_factory=lambda _config: encoder,
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
    )
    await engine.start()
    try:
        info = engine.info()  # the rank's READY, after its reservation step honoured the override
        assert (info.reserved_memory_bytes, info.reserved_source) == ({0: 2**28}, "override")
        item = fake_item(2, 2, seed=3)
        held = asyncio.create_task(
            encode(engine, "r1", [item], ["a"], deadline=deadline(), return_embeddings=True)
        )
        await asyncio.sleep(
            3 * config.heartbeat_s
        )  # held in the forward past the silence the watchdog allows
        assert engine.readiness() == Readiness(True, "ok")  # the rank's liveness thread kept reporting
        gate.set()
        [result] = await held
        torch.testing.assert_close(result.embedding, encoder.encode([item])[0].embedding, rtol=0, atol=0)
        assert (
            metrics.value("vitserve_stage_seconds_sum", stage="forward") or 0
        ) > 0  # the loop's reply timed it
    finally:
        await engine.shutdown()
    assert "did not stop cleanly" not in caplog.text  # STOP ended RankWorker.serve() with exit code 0
