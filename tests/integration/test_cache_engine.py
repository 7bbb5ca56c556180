"""The encoder-output cache and in-flight deduplication in the real engine (spawned ranks, FakeEncoder):
hits skip the encoder but still reach the LLM in order, N identical images cost one encode, and one
waiter leaving (cancel or timeout) never cancels the encode another request still waits for."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import pytest
import torch

from tests.fakes import FakeEncoderFactory, fake_item, fake_reference
from tests.integration.engine_helpers import all_pids, assert_gone, deadline, make_config
from tests.integration.engine_helpers import encode as engine_encode
from tests.receivers import ReceiverThread
from vitserve.contract import EncodedImage
from vitserve.engine import Engine
from vitserve.engine.local_cache import cache_fingerprint, entry_nbytes
from vitserve.errors import Timeout
from vitserve.metrics import Metrics

ENTRY_BYTES = 16 * 32 * 4  # fake_item(4, 4): 16 tokens x embed_dim 32, fp32


def sha(name: str) -> str:
    """A content id as the API makes it (sha256 of the image bytes)."""
    return hashlib.sha256(name.encode()).hexdigest()


def image(seed: int):
    return fake_item(4, 4, seed=seed), sha(f"image-{seed}")


@contextlib.asynccontextmanager
async def running_engine(config, factory=None, **kwargs):
    """engine_helpers.running_engine, with the Engine's cache-related keyword arguments."""
    engine = Engine(config, Metrics(), encoder_factory=factory or FakeEncoderFactory(), environ={}, **kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
        assert_gone(all_pids(engine))


def waiters(engine, img) -> int:
    """Requests' images currently waiting on the one queued/in-flight encode of `img`."""
    job = engine.jobs.job(img[1])
    return job.claims if job is not None else 0


def encoded_images(engine) -> float:
    """Images handed to an encoder group so far (sum of the batch_images histogram)."""
    return engine.metrics.value("vitserve_batch_images_sum") or 0.0


async def until(cond, what: str, limit_s: float = 10.0) -> None:
    """Wait for a state change on the event loop (not a timing assertion: the limit only stops a hang)."""
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def encode(engine, rid, images, *, seconds=30.0, inline=True):
    items, ids = [i for i, _ in images], [d for _, d in images]
    return await engine_encode(engine, rid, items, ids, deadline=deadline(seconds), return_embeddings=inline)


async def test_hit_miss_eviction_and_fingerprint(tmp_path):
    # room for exactly two fake_item(4, 4) entries
    config = make_config(tmp_path, cache_gb=2.5 * ENTRY_BYTES / 1024**3)
    async with running_engine(config) as engine:
        m = engine.metrics
        assert engine.jobs.fingerprint == cache_fingerprint(
            config,
            weights=FakeEncoderFactory()(config).weights_digest,  # what rank 0 reported
            model_name="fake-encoder",
            family="qwen2_5_vl",
            dtype="float32",
            device="cpu",
        )
        a, b, c = image(1), image(2), image(3)

        (first,) = await encode(engine, "r1", [a])
        (again,) = await encode(engine, "r2", [a])
        assert (first.cached, again.cached) == (False, True)
        assert again.embedding.numpy().tobytes() == first.embedding.numpy().tobytes()
        torch.testing.assert_close(again.embedding, fake_reference(a[0]))
        assert again.timing.encode_ms == 0.0
        assert encoded_images(engine) == 1  # the hit never reached the encoder
        assert (
            m.value("vitserve_cache_hits_total", layer="local"),
            m.value("vitserve_cache_misses_total", layer="local"),
        ) == (1, 1)
        assert m.value("vitserve_images_total", outcome="cached") == 1
        assert m.value("vitserve_images_total", outcome="encoded") == 1
        assert m.value("vitserve_cache_bytes", layer="local") == ENTRY_BYTES

        await encode(engine, "r3", [b, c])  # a is the oldest: evicted to make room for c
        assert m.value("vitserve_cache_evictions_total", layer="local") == 1
        assert (
            m.value("vitserve_cache_bytes", layer="local") == 2 * ENTRY_BYTES <= engine.jobs.cache.max_bytes
        )
        (late,) = await encode(engine, "r4", [a])
        assert late.cached is False
        assert encoded_images(engine) == 4
        (hit_c,) = await encode(engine, "r5", [c], inline=False)  # a's return evicted b; c stays
        (miss_b,) = await encode(engine, "r6", [b], inline=False)
        assert (hit_c.cached, hit_c.embedding, miss_b.cached) == (True, None, False)
        assert encoded_images(engine) == 5


async def test_identical_concurrent_images_are_encoded_once(tmp_path):
    config = make_config(tmp_path)  # --cache_gb 0: deduplication still applies
    async with running_engine(config, FakeEncoderFactory(sleep_s=0.3)) as engine:
        assert engine.jobs.cache is None
        x = image(7)
        outs = await asyncio.gather(*(encode(engine, f"r{i}", [x, x]) for i in range(6)))
        assert encoded_images(engine) == 1  # 12 copies, one encode
        flags = [r.cached for results in outs for r in results]
        assert flags.count(False) == 1  # the image that caused the encode; the rest reused it
        for results in outs:
            for r in results:
                # exact by construction: one encode, its result copied to every waiter
                assert r.embedding.numpy().tobytes() == outs[0][0].embedding.numpy().tobytes()
        m = engine.metrics
        assert m.value("vitserve_images_total", outcome="encoded") == 1
        assert m.value("vitserve_images_total", outcome="cached") == 11
        assert len(engine.jobs) == 0
        (after,) = await encode(engine, "later", [x])  # no cache: a later request encodes again
        assert after.cached is False
        assert encoded_images(engine) == 2


async def test_opaque_ids_are_never_shared(tmp_path):
    """An id that is not a sha256 digest says nothing about the content: never deduplicated."""
    async with running_engine(make_config(tmp_path, cache_gb=0.001)) as engine:
        a, b = fake_item(4, 4, seed=1), fake_item(4, 4, seed=2)
        outs = await asyncio.gather(
            engine_encode(engine, "r1", [a], ["img"], deadline=deadline(), return_embeddings=True),
            engine_encode(engine, "r2", [b], ["img"], deadline=deadline(), return_embeddings=True),
        )
        torch.testing.assert_close(outs[1][0].embedding, fake_reference(b))
        assert encoded_images(engine) == 2
        assert len(engine.jobs.cache) == 0


async def test_a_leaving_waiter_never_cancels_the_shared_encode(tmp_path):
    config = make_config(tmp_path, cache_gb=0.001)
    async with running_engine(config, FakeEncoderFactory(sleep_s=0.5)) as engine:
        # 1) queued: the group is busy with a filler, x waits in the queue with two requests on it
        filler = asyncio.create_task(encode(engine, "filler", [image(100)]))
        await until(lambda: encoded_images(engine) == 1, "filler dispatched")
        x = image(1)
        first = asyncio.create_task(encode(engine, "first", [x]))
        second = asyncio.create_task(encode(engine, "second", [x]))
        await until(lambda: waiters(engine, x) == 2, "both requests wait on x")
        assert engine.queue_items == 1  # one queued copy of x
        first.cancel()  # client disconnect
        with pytest.raises(asyncio.CancelledError):
            await first
        assert engine.queue_items == 1  # still queued for `second`
        (res,) = await second
        torch.testing.assert_close(res.embedding, fake_reference(x[0]))
        await filler
        assert encoded_images(engine) == 2

        # 2) in flight: cancel the request that caused the encode; the joined one still gets the result
        y = image(2)
        owner = asyncio.create_task(encode(engine, "owner", [y]))
        await until(lambda: encoded_images(engine) == 3, "y dispatched")
        joined = asyncio.create_task(encode(engine, "joined", [y]))
        await until(lambda: waiters(engine, y) == 2, "joined waits on y")
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        (res,) = await joined
        assert res.cached is True
        torch.testing.assert_close(res.embedding, fake_reference(y[0]))
        assert encoded_images(engine) == 3

        # 3) a waiter's own deadline passes: it gets 504, the patient one the embedding; the queued item
        #    lives to the latest deadline among its waiters
        filler = asyncio.create_task(encode(engine, "filler2", [image(101)]))
        await until(lambda: encoded_images(engine) == 4, "filler2 dispatched")
        z = image(3)
        hasty = asyncio.create_task(encode(engine, "hasty", [z], seconds=0.2))
        patient = asyncio.create_task(encode(engine, "patient", [z]))
        with pytest.raises(Timeout):
            await hasty
        (res,) = await patient
        torch.testing.assert_close(res.embedding, fake_reference(z[0]))
        await filler

        # 4) the last waiter leaves while queued: the image is removed and never encoded nor cached
        filler = asyncio.create_task(encode(engine, "filler3", [image(102)]))
        await until(lambda: encoded_images(engine) == 6, "filler3 dispatched")
        w = image(4)
        gone = [asyncio.create_task(encode(engine, f"gone{i}", [w])) for i in range(2)]
        await until(lambda: engine.queue_items == 1, "w queued")
        for t in gone:
            t.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        assert engine.queue_items == 0
        await filler
        assert encoded_images(engine) == 6
        assert waiters(engine, w) == 0
        (fresh,) = await encode(engine, "w-again", [w])
        assert fresh.cached is False


async def test_cache_hits_reach_the_llm_in_request_order_byte_identical(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm"
    config = make_config(tmp_path, llm_endpoint=endpoint, cache_gb=0.001)
    a, b, c = image(1), image(2), image(3)
    with ReceiverThread(endpoint) as rx:
        async with running_engine(config) as engine:
            first = await encode(engine, "r1", [a, b])
            second = await encode(engine, "r2", [b, c, a])  # b and a from the cache, c encoded
            assert [r.cached for r in second] == [True, False, True]
            assert all(r.delivered for r in first + second)
            assert encoded_images(engine) == 3
            await asyncio.sleep(0.5)  # acks leave just before recv() returns to the receiver's thread
            got = list(rx.got)
    assert [(g.request_id, g.image_index, g.image_id) for g in got] == [
        ("r1", 0, a[1]),
        ("r1", 1, b[1]),
        ("r2", 0, b[1]),
        ("r2", 1, c[1]),
        ("r2", 2, a[1]),
    ]
    assert all(g.num_images == (2 if g.request_id == "r1" else 3) for g in got)
    inline = {("r1", k): r.embedding for k, r in enumerate(first)} | {
        ("r2", k): r.embedding for k, r in enumerate(second)
    }
    for g in got:
        assert g.embedding.numpy().tobytes() == inline[(g.request_id, g.image_index)].numpy().tobytes()
    assert got[2].embedding.numpy().tobytes() == got[1].embedding.numpy().tobytes()  # hit == original encode
    assert got[4].embedding.numpy().tobytes() == got[0].embedding.numpy().tobytes()


def test_entry_size_of_the_fake_encoder_output():
    assert entry_nbytes(EncodedImage(torch.zeros(16, 32))) == ENTRY_BYTES
