"""The engine's push to the LLM server (SPEC §3) with a real EmbeddingReceiver: order, exactly-once,
byte-identical to the inline embedding; back-pressure and 504 when the receiver stalls (RELIABILITY F7)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from tests.fakes import FakeEncoderFactory, fake_item
from tests.integration.engine_helpers import deadline, make_config, running_engine
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
            reqs = {f"r{i}": [fake_item(2 + (i + k) % 3, 4, seed=100 * i + k) for k in range(3)] for i in range(5)}
            outs = await asyncio.gather(*(
                engine.encode(rid, items, [f"{rid}-{k}" for k in range(3)], deadline=deadline(), return_embeddings=True)
                for rid, items in reqs.items()))
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


async def test_f7_stalled_receiver_blocks_sends_then_504_and_nothing_is_dropped(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    # 256 KB per message: ZMQ's queues (64 + 64 messages) fill long before the kernel's socket buffers matter
    factory = FakeEncoderFactory(embed_dim=4096)
    config = make_config(tmp_path, llm_endpoint=endpoint, visual_batch_max_tokens=256, visual_infer_batch_size=16,
                         max_queue_tokens=100_000)
    with EmbeddingReceiver(endpoint, bind=True) as rx:
        async with running_engine(config, factory) as engine:
            slow = [rx.recv(timeout_s=0.01) for _ in range(0)]  # the receiver reads nothing from here on
            reqs = {f"r{i}": [fake_item(4, 4, seed=100 * i + k) for k in range(14)] for i in range(12)}
            tasks = {rid: asyncio.create_task(engine.encode(rid, items, [str(k) for k in range(14)],
                                                            deadline=deadline(6.0), return_embeddings=False))
                     for rid, items in reqs.items()}
            done = await asyncio.gather(*tasks.values(), return_exceptions=True)
            outcomes = dict(zip(tasks, done, strict=True))
            timeouts = [rid for rid, out in outcomes.items() if isinstance(out, Timeout)]
            assert timeouts, "the stalled receiver never made a send block until the deadline"
            assert all(isinstance(out, list | Timeout) for out in outcomes.values()), outcomes
            sent = engine.llm_messages_sent
            got = slow + await asyncio.to_thread(_drain, rx)  # the receiver comes back and drains
    assert len(got) == sent  # nothing handed to ZMQ was dropped
    per_request = defaultdict(list)
    for msg in got:
        per_request[msg.request_id].append(msg.image_index)
    for rid, indices in per_request.items():
        assert indices == list(range(len(indices)))  # in order, no gaps, no duplicates
        if isinstance(outcomes[rid], list):
            assert len(indices) == 14  # a 200 means every image was handed over


async def test_bad_llm_endpoint_fails_start_before_spawning(tmp_path):
    from vitserve.engine import Engine
    from vitserve.errors import ConfigError
    from vitserve.metrics import Metrics

    engine = Engine(make_config(tmp_path, llm_endpoint="http://nope"), Metrics(), environ={})
    with pytest.raises(ConfigError, match="--llm_endpoint"):
        await engine.start()
    assert engine.worker_pids() == {}
    await engine.shutdown()
