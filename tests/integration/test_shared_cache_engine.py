"""Two real Engines (spawned ranks, FakeEncoder) as two replicas sharing one Redis-protocol server:
an image encoded by A is served to B without an encode, with the same bytes, and fills B's local cache;
two replicas given the same new image at once encode it once; Redis killed mid-run fails no request."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import pytest

from tests.fakes import FakeEncoderFactory, fake_item
from tests.integration.engine_helpers import all_pids, assert_gone, deadline, make_config
from tests.integration.engine_helpers import encode as engine_encode
from tests.redis_server import redis_server
from vitserve.engine import Engine
from vitserve.metrics import Metrics

pytestmark = pytest.mark.timeout(240)


def image(seed: int):
    return fake_item(4, 4, seed=seed), hashlib.sha256(f"image-{seed}".encode()).hexdigest()


def encoded_images(engine) -> float:
    """Images handed to an encoder group so far (sum of the batch_images histogram)."""
    return engine.metrics.value("vitserve_batch_images_sum") or 0.0


async def encode(engine, rid, images):
    items, ids = [i for i, _ in images], [d for _, d in images]
    return await engine_encode(engine, rid, items, ids, deadline=deadline(30.0), return_embeddings=True)


@contextlib.asynccontextmanager
async def replicas(config, factory):
    engines = [Engine(config, Metrics(), encoder_factory=factory, environ={}) for _ in range(2)]
    await asyncio.gather(*(e.start() for e in engines))
    try:
        yield engines
    finally:
        for engine in engines:
            await engine.shutdown()
            assert_gone(all_pids(engine))


async def test_two_replicas_share_one_redis(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        config = make_config(tmp_path, cache_gb=0.01, cache_url=server.url)
        # a slow encode, so that both replicas ask for image 2 while it is still being encoded
        async with replicas(config, FakeEncoderFactory(sleep_s=0.5)) as (a, b):
            assert a._jobs.fingerprint == b._jobs.fingerprint
            one = image(1)
            (on_a,) = await encode(a, "a1", [one])
            (on_b,) = await encode(b, "b1", [one])
            assert (on_a.cached, on_b.cached) == (False, True)
            assert on_b.embedding.numpy().tobytes() == on_a.embedding.numpy().tobytes()
            assert on_b.timing.encode_ms == 0.0
            assert encoded_images(b) == 0  # B encoded nothing
            mb = b.metrics
            assert mb.value("vitserve_cache_hits_total", layer="shared") == 1
            assert mb.value("vitserve_images_total", outcome="cached") == 1
            (again,) = await encode(b, "b2", [one])  # now from B's own local cache
            assert again.cached and mb.value("vitserve_cache_hits_total", layer="local") == 1  # noqa: PT018

            two = image(2)  # new to both, at the same moment: one encode between them (the lease)
            both = await asyncio.gather(encode(a, "a2", [two]), encode(b, "b3", [two]))
            assert encoded_images(a) + encoded_images(b) == 2  # image 1 on A, image 2 once
            assert both[0][0].embedding.numpy().tobytes() == both[1][0].embedding.numpy().tobytes()
            # the replica that did not encode image 2 joined the other's encode (the lease) or hit its value
            shared_hits = sum(
                e.metrics.value("vitserve_cache_hits_total", layer="shared") or 0 for e in (a, b)
            )
            assert shared_hits == 2  # image 1 on B, image 2 on one of them

            before = encoded_images(b)
            server.kill()  # mid-run: every request still succeeds through the local path
            three, four = image(3), image(4)
            results = await asyncio.gather(
                encode(a, "a3", [three, one]), encode(b, "b4", [three]), encode(b, "b5", [four])
            )
            assert [len(r) for r in results] == [2, 1, 1]
            errors = sum(
                b.metrics.value("vitserve_cache_errors_total", layer="shared", kind=kind) or 0
                for kind in ("unavailable", "timeout")
            )
            assert errors >= 1
            assert encoded_images(b) == before + 2  # 3 and 4: nothing to share while Redis is gone
