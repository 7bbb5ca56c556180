"""The engine's push to the LLM server (docs/integration.md) with a real EmbeddingReceiver: order, exactly-once,
byte-identical to the inline embedding; back-pressure and 504 when the receiver stalls (scenario F7)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from tests.fakes import FakeEncoderFactory, fake_item
from tests.integration.engine_helpers import deadline, encode, make_config, running_engine
from vitserve.errors import Timeout
from vitserve.rpc import EmbeddingReceiver


def _drain(rx: EmbeddingReceiver, timeout_s: float = 1.0) -> list:
    got = []
    while True:
        try:
            got.append(rx.recv(timeout_s=timeout_s))
        except TimeoutError:
            return got


async def test_every_image_arrives_once_in_request_order_byte_identical(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    with EmbeddingReceiver(endpoint, bind=True) as rx:
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
            got = await asyncio.to_thread(_drain, rx)
            assert engine.llm_messages_sent == 15
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


async def test_f7_receiver_slow_then_gone_blocks_then_504_and_nothing_is_dropped(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    # 256 KB per message: the ZMQ queues (SNDHWM + RCVHWM messages) fill before kernel buffers matter
    factory = FakeEncoderFactory(embed_dim=4096)
    config = make_config(
        tmp_path, llm_endpoint=endpoint, visual_batch_max_tokens=256, visual_infer_batch_size=16
    )
    got = []

    async def run(engine, prefix: str, n_requests: int, n_images: int, seconds: float) -> dict:
        reqs = {
            f"{prefix}{i}": [fake_item(4, 4, seed=100 * i + k) for k in range(n_images)]
            for i in range(n_requests)
        }
        outs = await asyncio.gather(
            *(
                encode(
                    engine,
                    rid,
                    items,
                    [str(k) for k in range(n_images)],
                    deadline=deadline(seconds),
                    return_embeddings=False,
                )
                for rid, items in reqs.items()
            ),
            return_exceptions=True,
        )
        return dict(zip(reqs, outs, strict=True))

    async with running_engine(config, factory) as engine:
        with EmbeddingReceiver(endpoint, bind=True) as rx:
            slow = await run(engine, "slow", 6, 8, 5.0)  # the receiver reads nothing while they run
            assert any(isinstance(out, Timeout) for out in slow.values()), "sends never blocked"
            assert all(isinstance(out, list | Timeout) for out in slow.values()), slow
            got += await asyncio.to_thread(_drain, rx)  # it reads again ...
        # ... and is gone: sends queue up to the high-water mark, then block until the deadline
        gone = await run(engine, "gone", 1, 24, 3.0)
        assert isinstance(gone["gone0"], Timeout)
        with EmbeddingReceiver(endpoint, bind=True) as rx:  # a receiver comes back on the same endpoint
            got += await asyncio.to_thread(_drain, rx)
        sent = engine.llm_messages_sent
    assert len(got) == sent  # every message handed to ZMQ arrived; nothing was dropped
    per_request = defaultdict(list)
    for msg in got:
        per_request[msg.request_id].append(msg.image_index)
    outcomes = {**slow, **gone}
    for rid, indices in per_request.items():
        assert indices == list(range(len(indices)))  # in order, no gaps, no duplicates
        if isinstance(outcomes[rid], list):
            assert len(indices) == 8  # a 200 means every image was handed over


async def test_bad_llm_endpoint_fails_start_before_spawning(tmp_path):
    from vitserve.engine import Engine
    from vitserve.errors import ConfigError
    from vitserve.metrics import Metrics

    engine = Engine(make_config(tmp_path, llm_endpoint="http://nope"), Metrics(), environ={})
    with pytest.raises(ConfigError, match="--llm_endpoint"):
        await engine.start()
    assert engine.worker_pids() == {}
    await engine.shutdown()
