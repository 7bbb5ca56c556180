"""The shared cache layer (engine/shared_cache.py) against a real Redis-protocol server (tests/redis_server.py):
round trip and TTL, a corrupt value, the server killed and restarted, a full server, and the cross-replica
lease between two SharedCache objects (two replicas) on one server."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import pytest
import torch

from tests.fakes import fake_item
from tests.redis_server import redis_server
from vitserve.contract import EncodedImage
from vitserve.engine.entry_format import encode_entry
from vitserve.engine.jobs import Job
from vitserve.engine.shared_cache import KEY_PREFIX, LEASE_PREFIX, SharedCache
from vitserve.metrics import Metrics

pytestmark = pytest.mark.timeout(120)
LOGGER = "vitserve.engine.shared_cache"


def encoded(seed: int, tokens: int = 16, dim: int = 32, deepstack: int = 2) -> EncodedImage:
    gen = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)  # noqa: E731
    return EncodedImage(embedding=make(), deepstack=[make() for _ in range(deepstack)])


def same_bytes(a: EncodedImage, b: EncodedImage) -> bool:
    pairs = zip([a.embedding, *a.deepstack], [b.embedding, *b.deepstack], strict=True)
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def job_for(name: str, job_id: int = 0, seconds: float = 60.0) -> Job:
    key = "fp:" + hashlib.sha256(name.encode()).hexdigest()
    loop = asyncio.get_running_loop()
    return Job(job_id, key, fake_item(2, 2, seed=job_id), time.monotonic() + seconds, loop.create_future(), 1)


async def until(cond, what: str, limit_s: float = 20.0) -> None:
    """Wait for a state change (the limit only stops a hang; nothing here is a timing assertion)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as srv:
        yield srv


async def test_round_trip_ttl_and_metrics(server):
    m = Metrics()
    cache = SharedCache(server.url, 60.0, m)
    try:
        value = encoded(1)
        assert await cache.get(KEY_PREFIX + "a") is None
        await cache.put(KEY_PREFIX + "a", value)
        back = await cache.get(KEY_PREFIX + "a")
        assert back is not None and same_bytes(back, value)  # noqa: PT018
        assert 0 < server.client().pttl(KEY_PREFIX + "a") <= 60_000
        size = len(encode_entry(value))
        assert m.value("vitserve_cache_hits_total", layer="shared") == 1
        assert m.value("vitserve_cache_misses_total", layer="shared") == 1
        assert m.value("vitserve_cache_written_bytes_total", layer="shared") == size
        assert m.value("vitserve_cache_read_bytes_total", layer="shared") == size
    finally:
        await cache.close()
    no_ttl = SharedCache(server.url, 0.0, Metrics())
    try:
        await no_ttl.put(KEY_PREFIX + "b", encoded(2))
        assert server.client().pttl(KEY_PREFIX + "b") == -1  # no expiry: maxmemory-policy evicts
    finally:
        await no_ttl.close()


async def test_a_corrupt_or_truncated_value_is_a_miss_counted_and_deleted(server, caplog):
    m = Metrics()
    cache = SharedCache(server.url, 0.0, m)
    whole = encode_entry(encoded(3))
    try:
        for n, bad in enumerate([whole[: len(whole) // 2], whole[:-1] + bytes([whole[-1] ^ 1]), b"junk"]):
            server.client().set(KEY_PREFIX + f"bad{n}", bad)
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                assert await cache.get(KEY_PREFIX + f"bad{n}") is None
            assert not server.client().exists(KEY_PREFIX + f"bad{n}")
        assert m.value("vitserve_cache_errors_total", layer="shared", kind="corrupt") == 3
        assert m.value("vitserve_cache_misses_total", layer="shared") == 3
        assert m.value("vitserve_cache_hits_total", layer="shared") is None
        assert sum("unreadable value" in r.getMessage() for r in caplog.records) == 3
    finally:
        await cache.close()


async def test_redis_killed_then_restarted_one_warning_then_back_by_itself(server, caplog):
    m = Metrics()
    cache = SharedCache(server.url, 0.0, m)
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        await cache.put(KEY_PREFIX + "x", encoded(4))
        server.kill()
        for n in range(20):  # every call answers (a miss), none raises
            assert await cache.get(KEY_PREFIX + "x") is None
            await cache.put(KEY_PREFIX + f"y{n}", encoded(n))
            await asyncio.sleep(0.01)
        assert m.value("vitserve_cache_errors_total", layer="shared", kind="unavailable") >= 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()  # noqa: PT018
        server.start()  # same port, empty (no persistence)
        value = encoded(5)

        async def stored() -> bool:
            await cache.put(KEY_PREFIX + "z", value)
            return server.client().exists(KEY_PREFIX + "z") == 1

        end = time.monotonic() + 20  # the skip window after a failure is at most OUTAGE_BACKOFF_CAP_S
        while not await stored():
            assert time.monotonic() < end, "the client never reconnected"
            await asyncio.sleep(0.05)
        back = await cache.get(KEY_PREFIX + "z")
        assert back is not None and same_bytes(back, value)  # noqa: PT018
        assert [r.getMessage() for r in caplog.records if "is back" in r.getMessage()]
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    finally:
        await cache.close()


async def test_a_full_server_refuses_writes_without_failing_anything(tmp_path, caplog):
    with redis_server(tmp_path / "full", maxmemory="3mb", policy="noeviction") as srv:
        m = Metrics()
        cache = SharedCache(srv.url, 0.0, m)
        big = encoded(6, tokens=512, dim=256, deepstack=0)  # 256 KiB of bf16
        try:
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                for n in range(40):  # 10 MiB into 3 MiB
                    await cache.put(KEY_PREFIX + f"k{n}", big)
            assert m.value("vitserve_cache_errors_total", layer="shared", kind="full") >= 1
            full = [r for r in caplog.records if "refuses writes" in r.getMessage()]
            assert len(full) == 1 and "allkeys-lru" in full[0].getMessage()  # noqa: PT018
            back = await cache.get(KEY_PREFIX + "k0")  # reads go on
            assert back is not None and same_bytes(back, big)  # noqa: PT018
        finally:
            await cache.close()


# ------------------------------------------------------------------------------ cross-replica lease


async def test_the_second_replica_waits_for_the_first_ones_encode(server):
    ma, mb = Metrics(), Metrics()
    a, b = SharedCache(server.url, 0.0, ma), SharedCache(server.url, 0.0, mb)
    dispatched_a: list[Job] = []
    dispatched_b: list[Job] = []
    try:
        job_a, job_b = job_for("img", 1), job_for("img", 2)
        a.submit([job_a], dispatched_a.extend)
        await until(lambda: dispatched_a, "A dispatches its miss")
        assert server.client().exists(LEASE_PREFIX + job_a.key)
        b.submit([job_b], dispatched_b.extend)
        await until(lambda: mb.value("vitserve_cache_misses_total", layer="shared"), "B looked")
        await asyncio.sleep(0.2)  # B polls meanwhile; it must not encode while A holds the lease
        assert dispatched_b == [] and not job_b.future.done()  # noqa: PT018
        value = encoded(7)
        job_a.settle(result=value)  # A's encoder finished: A stores it and gives the lease up
        result = await asyncio.wait_for(job_b.future, 20)
        assert same_bytes(result, value) and job_b.from_shared  # noqa: PT018
        assert dispatched_b == []
        assert ma.value("vitserve_cache_leases_total", outcome="taken") == 1
        assert mb.value("vitserve_cache_leases_total", outcome="joined") == 1
        await until(lambda: not server.client().exists(LEASE_PREFIX + job_a.key), "A released its lease")
    finally:
        await a.close()
        await b.close()


async def test_a_failed_or_dead_holder_does_not_block_the_others(server):
    a = SharedCache(server.url, 0.0, Metrics(), lease_s=600.0)
    mb = Metrics()
    b = SharedCache(server.url, 0.0, mb, lease_s=600.0)
    dispatched: list[Job] = []
    try:
        job_a, job_b = job_for("failing", 1), job_for("failing", 2)
        a.submit([job_a], lambda jobs: None)
        await until(lambda: server.client().exists(LEASE_PREFIX + job_a.key), "A took the lease")
        b.submit([job_b], dispatched.extend)
        await asyncio.sleep(0.1)
        assert dispatched == []
        job_a.settle(exc=RuntimeError("encoder failed"))  # A gives the lease up without a value
        await until(lambda: dispatched == [job_b], "B encodes itself long before the 600 s lease")
        assert mb.value("vitserve_cache_leases_total", outcome="expired") == 1
    finally:
        await a.close()
        await b.close()
    # a replica that died holding a lease: the lease's PX ends the wait
    server.client().set(LEASE_PREFIX + "fp:dead", "gone-replica", px=300)
    c = SharedCache(server.url, 0.0, Metrics(), lease_s=0.3)
    dispatched.clear()
    try:
        job = Job(
            3,
            "fp:dead",
            fake_item(2, 2, seed=3),
            time.monotonic() + 60,
            asyncio.get_running_loop().create_future(),
            1,
        )
        c.submit([job], dispatched.extend)
        await until(lambda: dispatched == [job], "the dead replica's lease expires")
    finally:
        await c.close()


async def test_jobs_without_a_content_id_and_an_outage_go_to_the_encoder(tmp_path):
    cache = SharedCache("redis://127.0.0.1:1/0", 0.0, Metrics())  # nothing listens on port 1
    dispatched: list[Job] = []
    try:
        unkeyed = job_for("x", 1)
        unkeyed.key = ""
        keyed = job_for("y", 2)
        cache.submit([unkeyed, keyed], dispatched.extend)
        assert dispatched == [unkeyed]  # at once, no lookup
        await until(lambda: keyed in dispatched, "the lookup fails and the image is encoded locally")
        assert cache.metrics.value("vitserve_cache_errors_total", layer="shared", kind="unavailable") >= 1
    finally:
        await cache.close()


async def test_closing_ends_the_jobs_still_waiting_on_another_replica(server):
    from vitserve.errors import NotReady

    server.client().set(LEASE_PREFIX + "fp:held", "another-replica", px=600_000)
    cache = SharedCache(server.url, 0.0, Metrics())
    job = Job(
        4,
        "fp:held",
        fake_item(2, 2, seed=4),
        time.monotonic() + 60,
        asyncio.get_running_loop().create_future(),
        1,
    )
    cache.submit([job], lambda jobs: None)
    await until(lambda: cache.metrics.value("vitserve_cache_misses_total", layer="shared"), "looked up")
    await cache.close()  # engine shutdown: the Job must not wait out the lease
    with pytest.raises(NotReady):
        job.future.result()


async def test_a_hung_server_costs_a_timeout_not_a_failure(server, caplog):
    m = Metrics()
    cache = SharedCache(server.url, 0.0, m)
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        await cache.put(KEY_PREFIX + "h", encoded(8))
        server.pause()
        try:
            assert await cache.get(KEY_PREFIX + "h") is None  # after the socket timeout: a miss
            await cache.put(KEY_PREFIX + "h2", encoded(9))  # skipped, or one more timeout: never raises
        finally:
            server.resume()
        assert m.value("vitserve_cache_errors_total", layer="shared", kind="timeout") >= 1
        end = time.monotonic() + 20
        while await cache.get(KEY_PREFIX + "h") is None:
            assert time.monotonic() < end, "never answered again after SIGCONT"
            await asyncio.sleep(0.05)
        assert [r for r in caplog.records if "is back" in r.getMessage()]
    finally:
        await cache.close()


async def test_a_value_of_tens_of_mb_with_deepstack_round_trips(server, monkeypatch):
    from vitserve.engine import shared_cache

    monkeypatch.setattr(shared_cache, "SOCKET_TIMEOUT_S", 60.0)  # the size is under test here, not the speed
    cache = SharedCache(server.url, 0.0, Metrics())
    big = encoded(10, tokens=2048, dim=2048, deepstack=3)  # 4 x 8 MiB of bf16
    try:
        await cache.put(KEY_PREFIX + "big", big)
        assert server.client().strlen(KEY_PREFIX + "big") > 32 * 2**20
        back = await cache.get(KEY_PREFIX + "big")
        assert back is not None and same_bytes(back, big)  # noqa: PT018
    finally:
        await cache.close()
