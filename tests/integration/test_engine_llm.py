"""The engine's push to the LLM server (docs/wire.md) with real EmbeddingReceivers: order, exactly-once,
byte-identical to the inline embedding; a receiver that is slow, hangs, dies or restarts (its own process)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from tests.fakes import fake_item
from tests.integration.engine_helpers import deadline, encode, make_config, running_engine
from tests.receivers import ReceiverProcess, ReceiverThread
from vitserve.errors import LLMTimeout


async def test_every_image_arrives_once_in_request_order_byte_identical(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    with ReceiverThread(endpoint) as rx:
        async with running_engine(make_config(tmp_path, tp=2, llm_endpoint=endpoint)) as engine:
            reqs = {
                f"r{i}": [fake_item(2 + (i + k) % 3, 4, seed=100 * i + k) for k in range(3)] for i in range(5)
            }
            outs = await asyncio.gather(
                *(
                    encode(
                        engine,
                        rid,
                        items,
                        [f"{rid}-{k}" for k in range(3)],
                        deadline=deadline(),
                        return_embeddings=True,
                    )
                    for rid, items in reqs.items()
                )
            )
            inline = dict(zip(reqs, outs, strict=True))
            # every image was acknowledged; recv() sends the ack just before it returns to its thread
            end = time.monotonic() + 10
            while len(rx.got) < 15 and time.monotonic() < end:
                await asyncio.sleep(0.01)
            got = list(rx.got)
            assert engine.llm_messages_sent == 15
            assert all(r.delivered for out in outs for r in out)
    seen = defaultdict(list)
    for msg in got:
        seen[msg.request_id].append(msg.image_index)
        expected = inline[msg.request_id][msg.image_index].embedding
        assert msg.embedding.numpy().tobytes() == expected.numpy().tobytes()
        assert msg.image_id == f"{msg.request_id}-{msg.image_index}"
        assert msg.num_images == 3
        assert msg.model == "fake-encoder"
        assert tuple(msg.grid_thw) == reqs[msg.request_id][msg.image_index].grid_thw
    assert dict(seen) == {rid: [0, 1, 2] for rid in reqs}  # once each, in order


def _images(n: int, seed: int = 0) -> list:
    return [fake_item(4, 4, seed=seed + k) for k in range(n)]


async def _encode(engine, request_id: str, n: int, seconds: float):
    return await encode(
        engine, request_id, _images(n), [f"{request_id}-{k}" for k in range(n)],
        deadline=deadline(seconds), return_embeddings=False,
    )  # fmt: skip


async def test_slow_receiver_that_acknowledges_in_time_gets_200_delivered(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    with ReceiverProcess(endpoint, delay_s=0.3) as rx:
        async with running_engine(make_config(tmp_path, llm_endpoint=endpoint)) as engine:
            results = await _encode(engine, "slow", 4, 20.0)  # ~1.2 s of the receiver's delays
            assert [r.delivered for r in results] == [True] * 4
            assert engine.metrics.llm_messages_total.labels(outcome="delivered")._value.get() == 4
    assert [(m["request_id"], m["image_index"]) for m in rx.messages] == [("slow", k) for k in range(4)]


async def test_hung_receiver_gives_llm_timeout_and_drops_the_expired_message_when_it_reads_again(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    async with running_engine(make_config(tmp_path, llm_endpoint=endpoint)) as engine:
        with ReceiverProcess(endpoint, read_after_s=8.0) as rx:  # connected, but reads nothing for 8 s
            while not engine.readiness().ready:  # the receiver is reachable although it does not read
                await asyncio.sleep(0.01)
            with pytest.raises(LLMTimeout) as info:
                await _encode(engine, "hung", 2, 2.0)
            assert (info.value.status, info.value.code) == (504, "llm_timeout")
            outcomes = engine.metrics.llm_messages_total
            assert outcomes.labels(outcome="llm_timeout")._value.get() == 1
            sender = engine._push._sender
            gone = asyncio.create_task(_encode(engine, "gone", 1, 60.0))  # its client then disconnects
            while sender.messages_sent < 2:  # "hung" image 0, then this one: waiting for its ack
                await asyncio.sleep(0.01)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert outcomes.labels(outcome="withdrawn")._value.get() == 1
            rx.wait_for(lambda: rx.stats.get("expired") == 1, "dropped the expired message")
            # "hung" was never handed to the application; "gone" had left for the receiver already and
            # had not expired, so it arrives although nobody waits for it (docs/wire.md)
            rx.wait_for(lambda: len(rx.messages) == 1, "returned the withdrawn message")
            assert [m["request_id"] for m in rx.messages] == ["gone"]
            results = await _encode(engine, "later", 1, 20.0)  # it reads now: a new request goes through
            assert results[0].delivered


async def test_receiver_killed_then_restarted_on_the_same_endpoint(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    async with running_engine(make_config(tmp_path, llm_endpoint=endpoint)) as engine:
        with ReceiverProcess(endpoint) as first:
            assert (await _encode(engine, "before", 1, 20.0))[0].delivered
            first.kill()  # SIGKILL: dies without closing its socket
            with pytest.raises(LLMTimeout):
                await _encode(engine, "during", 2, 2.0)
        assert not engine.readiness().ready
        assert "--llm_endpoint" in engine.readiness().reason
        with ReceiverProcess(endpoint) as second:
            results = await _encode(engine, "after", 2, 20.0)  # new work reaches it at once
            assert [r.delivered for r in results] == [True, True]
            await asyncio.sleep(1.0)  # anything stale would have arrived by now
            assert engine.readiness().ready
    assert [m["request_id"] for m in first.messages] == ["before"]
    assert [(m["request_id"], m["image_index"]) for m in second.messages] == [("after", 0), ("after", 1)]
    assert second.stats.get("expired", 0) == 0  # "during" never even reached its queue


async def test_bad_llm_endpoint_fails_start_before_spawning(tmp_path):
    from vitserve.engine import Engine
    from vitserve.errors import ConfigError
    from vitserve.metrics import Metrics

    engine = Engine(make_config(tmp_path, llm_endpoint="http://nope"), Metrics(), environ={})
    with pytest.raises(ConfigError, match="--llm_endpoint"):
        await engine.start()
    assert engine.worker_pids() == {}
    await engine.shutdown()


async def test_traceparent_travels_in_the_wire_header(tmp_path):
    from vitserve.contract import EncodeRequest, PreparedImage

    endpoint = f"ipc://{tmp_path}/llm"
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    item = fake_item(4, 4, seed=7)
    with ReceiverThread(endpoint) as rx:
        async with running_engine(make_config(tmp_path, llm_endpoint=endpoint)) as engine:
            for rid, parent in (("traced", tp), ("plain", None)):
                image = PreparedImage(item, f"{rid}-0", item.resized_size, 0.0, 0.0)
                request = EncodeRequest(rid, (image,), deadline(), False, traceparent=parent)
                assert (await engine.encode(request))[0].delivered
            end = time.monotonic() + 10
            while len(rx.got) < 2 and time.monotonic() < end:
                await asyncio.sleep(0.01)
    assert [(m.request_id, m.traceparent) for m in rx.got] == [("traced", tp), ("plain", None)]
