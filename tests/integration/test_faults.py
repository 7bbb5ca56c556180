"""docs/design.md invariant 5: dead, hung and failing ranks are found well before --dist_timeout_s, every
accepted request completes with EncoderFailed, and no worker process outlives its group."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.fakes import FakeEncoderFactory, fake_item
from tests.integration.engine_helpers import (
    all_pids,
    assert_gone,
    deadline,
    encode,
    kill_quietly,
    make_config,
    running_engine,
)
from vitserve.errors import ConfigError, EncoderFailed

HEARTBEAT_S = 1.0  # 2 x 1 s of silence = hung; shorter flakes on a loaded 2-core machine
DIST_TIMEOUT_S = 10.0
# solo: failures must be found within heartbeats and well before DIST_TIMEOUT_S; a test on another xdist
# worker would add its own load to those limits
pytestmark = pytest.mark.solo


def _config(tmp_path, **kw):
    return make_config(tmp_path, tp=2, heartbeat_s=HEARTBEAT_S, dist_timeout_s=DIST_TIMEOUT_S, **kw)


def _request(engine, name: str, n: int = 1):
    items = [fake_item(4, 4, seed=hash(name) % 1000 + k) for k in range(n)]
    return asyncio.create_task(
        encode(engine, name, items, [str(k) for k in range(n)], deadline=deadline(), return_embeddings=False)
    )


async def _wait_not_ready(engine, within_s: float) -> float:
    start = time.monotonic()
    while engine.readiness().ready:
        assert time.monotonic() - start < within_s, "readiness still true"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def test_sigkill_idle_rank_fails_group_and_new_requests(tmp_path):
    async with running_engine(_config(tmp_path)) as engine:
        pids = all_pids(engine)
        kill_quietly(pids[1], signal.SIGKILL)
        await _wait_not_ready(engine, within_s=2 * HEARTBEAT_S)
        assert "rank 1" in engine.readiness().reason
        await asyncio.wait_for(engine.failed.wait(), 1)
        with pytest.raises(EncoderFailed, match="no encoder group is left"):
            await encode(
                engine, "new", [fake_item(2, 2, 0)], ["a"], deadline=deadline(), return_embeddings=False
            )
        assert_gone(pids)  # rank 0 was torn down with its dead peer


async def test_queued_requests_fail_when_the_group_dies(tmp_path):
    async with running_engine(_config(tmp_path), FakeEncoderFactory(sleep_s=2.0)) as engine:
        pids = all_pids(engine)
        running, queued = (
            _request(engine, "a", n=4),
            _request(engine, "b", n=4),
        )  # 64-token budget: 1 batch each
        await asyncio.sleep(0.3)
        assert engine.queue_items >= 4
        kill_quietly(pids[1], signal.SIGKILL)
        for task in (running, queued):
            with pytest.raises(EncoderFailed):
                await task
        assert engine.queue_items == 0
        assert_gone(pids)


@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.slow), 1])
async def test_sigkill_mid_batch_errors_well_before_dist_timeout(tmp_path, victim):
    async with running_engine(_config(tmp_path), FakeEncoderFactory(sleep_s=3.0)) as engine:
        pids = all_pids(engine)
        task = _request(engine, "mid", n=2)
        await asyncio.sleep(0.5)  # the batch is inside the (slow) forward on both ranks
        start = time.monotonic()
        kill_quietly(pids[victim], signal.SIGKILL)
        with pytest.raises(EncoderFailed, match=f"rank {victim}"):
            await task
        assert time.monotonic() - start < 2.0  # vs --dist_timeout_s 10
        assert_gone(pids)


async def test_sigstop_is_found_by_missed_heartbeats(tmp_path):
    async with running_engine(_config(tmp_path), FakeEncoderFactory(sleep_s=1.0)) as engine:
        pids = all_pids(engine)
        task = _request(engine, "hung", n=2)
        await asyncio.sleep(0.3)
        start = time.monotonic()
        kill_quietly(pids[1], signal.SIGSTOP)
        try:
            with pytest.raises(EncoderFailed, match="missed heartbeats"):
                await task
            assert time.monotonic() - start < 2 * HEARTBEAT_S + 1.5
            assert not engine.readiness().ready
            assert_gone(pids)  # SIGKILL also ends a stopped process
        finally:
            kill_quietly(pids[1], signal.SIGCONT)
            kill_quietly(pids[1], signal.SIGKILL)


async def test_forward_raises_on_one_rank_only(tmp_path):
    async with running_engine(_config(tmp_path), FakeEncoderFactory(raise_on_rank=1)) as engine:
        pids = all_pids(engine)
        start = time.monotonic()
        with pytest.raises(EncoderFailed, match="injected failure on rank 1"):
            await _request(engine, "boom", n=2)
        assert (
            time.monotonic() - start < 3.0
        )  # rank 0 was stuck in all_gather; it did not wait for the timeout
        assert_gone(pids)


async def test_startup_failure_names_the_knob_and_leaves_no_orphans(tmp_path):
    from vitserve.engine import Engine
    from vitserve.metrics import Metrics

    engine = Engine(
        _config(tmp_path), Metrics(), encoder_factory=FakeEncoderFactory(embed_dim=33), environ={}
    )
    with pytest.raises(ConfigError, match="not divisible by --tp 2"):
        await engine.start()
    assert_gone(all_pids(engine))
    await engine.shutdown()  # what a CLI does on its way out: harmless after a failed start
    assert engine.readiness().ready is False
