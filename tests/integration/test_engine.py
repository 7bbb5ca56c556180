"""The engine's happy path with real spawned ranks: dp=1 x tp=1 and tp=2 (gloo), FakeEncoder."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from tests.fakes import fake_item, fake_reference
from tests.integration.engine_helpers import (
    all_pids,
    assert_gone,
    deadline,
    encode,
    make_config,
    running_engine,
)
from vitserve.contract import Readiness
from vitserve.errors import NotReady, QueueFull


@pytest.mark.parametrize("tp", [1, 2])
async def test_encode_matches_reference_and_shuts_down_clean(tmp_path, tp):
    config = make_config(tmp_path, tp=tp)
    async with running_engine(config) as engine:
        assert engine.readiness() == Readiness(True, "ok")
        info = engine.info()
        assert (info.model, info.family, info.embed_dim, info.dtype) == (
            "fake-encoder",
            "qwen2_5_vl",
            32,
            "float32",
        )
        assert sorted(info.reserved_memory_bytes) == list(range(tp))
        assert info.reserved_source == "stress"
        files = sorted(f for f in os.listdir(config.runtime_dir) if f.startswith("reserved_mem_"))
        assert files == [f"reserved_mem_cpu_{r}.json" for r in range(tp)]
        with open(os.path.join(config.runtime_dir, files[0])) as f:
            assert json.load(f)["rank"] == 0

        items = [fake_item(4, 4, seed=1), fake_item(2, 8, seed=2), fake_item(8, 8, seed=3)]
        engine._dispatch.slots.min_bytes = 0  # these results are small: through a slot all the same
        read = engine._dispatch.slots.read
        results = await encode(
            engine, "r1", items, ["a", "b", "c"], deadline=deadline(), return_embeddings=True
        )
        assert engine._dispatch.slots.read > read  # rank 0 (another process) wrote them into a result slot
        assert [r.num_tokens for r in results] == [16, 16, 64]
        for item, res in zip(items, results, strict=True):
            torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
            assert res.timing.encode_ms > 0
        assert engine.metrics.value("vitserve_images_total", outcome="encoded") == 3
        assert engine.metrics.value("vitserve_workers_ready") == tp
        pids = all_pids(engine)
        await engine.shutdown()
        assert [p.exitcode for g in engine._dispatch.groups for p in g.processes] == [
            0
        ] * tp  # STOP, not kill
        assert engine.readiness().ready is False
        with pytest.raises(NotReady):
            await encode(engine, "late", items[:1], ["a"], deadline=deadline(), return_embeddings=False)
    assert_gone(pids)
    # reservation files removed on clean shutdown; the reservation cache stays for the next start
    assert sorted(os.listdir(config.runtime_dir)) == [f"reservation_cache_cpu_{r}.json" for r in range(tp)]


async def test_a_result_slot_rank_0_cannot_write_leaves_the_result_to_the_status_socket(tmp_path):
    # worker/slots.py: a slot rank 0 cannot open (here: no such fd in its process) is no failure; the frames
    # come as before, equal, and nothing is read from a slot
    async with running_engine(make_config(tmp_path)) as engine:
        slots = engine._dispatch.slots
        slots.lend = lambda nbytes: "/proc/self/fd/999999"  # type: ignore[method-assign]
        items = [fake_item(4, 4, seed=1), fake_item(2, 8, seed=2)]
        read = slots.read
        results = await encode(engine, "r1", items, ["a", "b"], deadline=deadline(), return_embeddings=True)
        for item, res in zip(items, results, strict=True):
            torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
        assert slots.read == read
        assert "held" not in slots.states()


async def test_concurrent_requests_batch_within_budget(tmp_path):
    config = make_config(tmp_path, visual_batch_max_tokens=64)
    async with running_engine(config) as engine:
        reqs = [[fake_item(2 + i % 3, 4, seed=10 * i + k) for k in range(3)] for i in range(6)]
        outs = await asyncio.gather(
            *(
                encode(
                    engine,
                    f"r{i}",
                    items,
                    [str(k) for k in range(3)],
                    deadline=deadline(),
                    return_embeddings=True,
                )
                for i, items in enumerate(reqs)
            )
        )
        for items, results in zip(reqs, outs, strict=True):
            for item, res in zip(items, results, strict=True):
                torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
        m = engine.metrics
        assert m.value("vitserve_batch_tokens_count") >= 18 * 8 / 64  # every batch fits the 64-token budget
        assert m.value("vitserve_batch_tokens_bucket", le="64.0") == m.value("vitserve_batch_tokens_count")
        assert engine.queue_tokens == 0
        assert engine.queue_items == 0


async def test_queue_full_names_the_flag(tmp_path):
    from tests.fakes import FakeEncoderFactory

    config = make_config(tmp_path, max_queue_tokens=64)  # the limit under test
    async with running_engine(config, FakeEncoderFactory(sleep_s=0.5)) as engine:
        first = asyncio.create_task(
            encode(
                engine,
                "big",
                [fake_item(8, 8, s) for s in range(3)],
                ["a", "b", "c"],
                deadline=deadline(),
                return_embeddings=False,
            )
        )
        await asyncio.sleep(0.1)  # one batch in flight, two images (128 tokens) queued
        with pytest.raises(QueueFull, match="--max_queue_tokens 64") as err:
            await encode(
                engine, "more", [fake_item(2, 2, 9)], ["x"], deadline=deadline(), return_embeddings=False
            )
        assert err.value.retry_after_s >= 1
        assert len(await first) == 3


async def test_cancelled_request_is_never_encoded_nor_sent(tmp_path):
    from tests.fakes import FakeEncoderFactory
    from tests.receivers import ReceiverThread

    log_dir = tmp_path / "hashes"
    log_dir.mkdir()
    endpoint = f"ipc://{tmp_path}/llm"
    config = make_config(tmp_path, llm_endpoint=endpoint, visual_batch_max_tokens=16)
    with ReceiverThread(endpoint) as rx:
        async with running_engine(
            config, FakeEncoderFactory(sleep_s=1.0, hash_log_dir=str(log_dir))
        ) as engine:
            first = asyncio.create_task(
                encode(
                    engine, "stay", [fake_item(4, 4, 1)], ["a"], deadline=deadline(), return_embeddings=False
                )
            )
            gone = asyncio.create_task(
                encode(
                    engine,
                    "gone",
                    [fake_item(4, 4, 2), fake_item(4, 4, 3)],
                    ["b", "c"],
                    deadline=deadline(),
                    return_embeddings=False,
                )
            )
            await asyncio.sleep(0.3)
            assert engine.queue_items == 2
            gone.cancel()  # the client disconnected while its images were queued
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert engine.queue_items == 0
            await first  # acknowledged by the receiver's thread
            await asyncio.sleep(1.0)  # anything else sent would have arrived by now
            received = list(rx.got)
        (log,) = os.listdir(log_dir)
        with open(log_dir / log) as f:
            assert len(f.read().split()) == 1  # only "stay" was encoded
    assert [m.request_id for m in received] == ["stay"]


async def test_deadline_passes_while_queued_gives_timeout_and_drops_the_items(tmp_path):
    from tests.fakes import FakeEncoderFactory
    from vitserve.errors import Timeout

    log_dir = tmp_path / "hashes"
    log_dir.mkdir()
    config = make_config(tmp_path, visual_batch_max_tokens=16)
    async with running_engine(config, FakeEncoderFactory(sleep_s=1.5, hash_log_dir=str(log_dir))) as engine:
        first = asyncio.create_task(
            encode(engine, "slow", [fake_item(4, 4, 1)], ["a"], deadline=deadline(), return_embeddings=False)
        )
        await asyncio.sleep(0.2)
        with pytest.raises(Timeout, match="--request_timeout_s"):
            await encode(
                engine, "late", [fake_item(4, 4, 2)], ["b"], deadline=deadline(0.5), return_embeddings=False
            )
        assert engine.queue_items == 0
        await first
        await asyncio.sleep(0.3)
    (log,) = os.listdir(log_dir)
    with open(log_dir / log) as f:
        assert len(f.read().split()) == 1
