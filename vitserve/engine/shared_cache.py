"""The shared cache layer (--cache_url): encoder outputs in Redis (or Valkey), read by every replica.

An image the local LRU (engine/local_cache.py) does not hold is looked up here before it is encoded:

    local hit -> done | shared hit -> fills the local cache, done | miss -> lease -> encode -> SET

- Keys: `vitserve:<fingerprint>:<sha256 of the image>`; the fingerprint covers the weights' content digest
  (vitserve/checkpoint.py, reported by rank 0) and every setting that changes the output (engine/local_cache.py), so replicas with
  other weights or settings never read each other's entries. Values: engine/entry_format.py (versioned,
  sha256-checked); a value that fails its check is counted, deleted and treated as a miss.
- Writes are one SET of the whole value (Redis applies it atomically), with PX --cache_ttl_s when set.
- Cross-replica in-flight dedup: the replica that misses first takes a lease (SET NX PX, LEASE_S) and
  encodes; another replica that misses while the lease is held polls for the value until it appears,
  the lease goes away (its holder failed or died), or LEASE_S passed; then it encodes itself. A dead
  replica's lease expires on its own.
- Failures never fail a request: an error is counted (vitserve_cache_errors_total{layer="shared"}), the
  image goes down the local path, and one WARNING is logged per outage (one INFO when it is back). While
  Redis is unreachable, lookups are skipped for a backoff (redis-py's ExponentialBackoff, at most
  OUTAGE_BACKOFF_CAP_S) so requests do not each wait for a connect; redis-py reconnects by itself.

Everything runs on the engine's event loop; (de)serialising a large entry runs in a thread.
The engine's modules import one way: service -> shared_cache -> jobs -> cache (a pyproject contract).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from vitserve.config import Config, redacted_url
from vitserve.contract import EncodedImage
from vitserve.engine.entry_format import EntryError, decode_entry, encode_entry
from vitserve.engine.jobs import Job
from vitserve.engine.local_cache import entry_nbytes
from vitserve.errors import NotReady
from vitserve.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

SHARED = "shared"  # the `layer` label of this layer's metrics
KEY_PREFIX = "vitserve:"
LEASE_PREFIX = "vitserve:lease:"
# One command, a tens-of-MB value included: a 40 MiB GET took 0.5 s on loopback on a loaded 2-core host.
# A timeout is not retried (one slow command per outage; then the backoff skips Redis).
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 0.5
LEASE_S = 10.0  # how long a replica waits for another's encode of the same image before encoding it too
POLL_S = 0.02  # how often a waiting replica looks for that value
OUTAGE_BACKOFF_CAP_S = 2.0  # while unreachable, Redis is tried again at most this long after a failure
INLINE_BYTES = 256 * 1024  # smaller entries are (de)serialised on the event loop, larger ones in a thread
# Delete a lease only when it is still ours (it may have expired and been taken by another replica).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


async def open_shared_cache(config: Config, metrics: Metrics) -> SharedCache | None:
    """The shared layer (--cache_url), or None without it. Logs whether Redis answers; an unreachable one
    is not fatal (the client connects again by itself)."""
    if config.cache_url is None:
        return None
    shared = SharedCache(config.cache_url, config.cache_ttl_s, metrics)
    await shared.check()
    return shared


class SharedCache:
    def __init__(
        self,
        url: str,
        ttl_s: float,
        metrics: Metrics,
        *,
        lease_s: float = LEASE_S,
        poll_s: float = POLL_S,
    ):
        self.url = redacted_url(url)
        self.metrics = metrics
        self.lease_s = lease_s
        self.poll_s = poll_s
        self._ttl_ms = int(ttl_s * 1000) or None
        self._redis = aredis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(
                ExponentialWithJitterBackoff(cap=0.05, base=0.01),
                retries=1,
                supported_errors=(RedisConnectionError,),  # a dropped connection: reconnect once
            ),
            health_check_interval=30,
            client_name="vitserve",
        )
        self._release = self._redis.register_script(_RELEASE)
        self._token = uuid.uuid4().hex  # this replica's lease value
        self._backoff = ExponentialBackoff(cap=OUTAGE_BACKOFF_CAP_S, base=0.05)
        self._failures = 0  # consecutive connection failures
        self._skip_until = 0.0
        self._down = False  # a WARNING was logged for this outage
        self._full = False  # a WARNING was logged: the server refuses writes (maxmemory)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # ------------------------------------------------------------------------------- life cycle

    async def check(self) -> None:
        """Log whether the server answers (start-up); an unreachable one is not fatal."""
        try:
            await self._redis.ping()
        except RedisError as exc:
            self._failed(exc)
            return
        log.info("shared cache at %s is reachable", self.url)

    async def close(self) -> None:
        self._closed = True  # encodes that finish from now on are not stored
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()

    # ------------------------------------------------------------------------------- the engine's hook

    def submit(self, jobs: list[Job], dispatch: Callable[[list[Job]], None]) -> None:
        """New Jobs (local misses): serve them from the shared layer, or hand them to `dispatch` to encode.

        Returns at once; the lookups run in a task of their own, so a request that goes away meanwhile
        cannot strand a Job that other requests have joined."""
        keyed = [job for job in jobs if job.key]
        unkeyed = [job for job in jobs if not job.key]  # no content id: never shared
        if unkeyed:
            dispatch(unkeyed)
        if not keyed:
            return
        if self._skipping():  # Redis is out: no task, no delay
            dispatch(keyed)
            return
        self._spawn(self._resolve(keyed, dispatch))

    async def _resolve(self, jobs: list[Job], dispatch: Callable[[list[Job]], None]) -> None:
        try:
            found = await asyncio.gather(*(self._lookup(job) for job in jobs))
            waiting = [job for job, state in zip(jobs, found, strict=True) if state == "leased_elsewhere"]
            self._dispatch_misses([j for j, s in zip(jobs, found, strict=True) if s == "miss"], dispatch)
            await asyncio.gather(*(self._wait_for(job, dispatch) for job in waiting))
        except asyncio.CancelledError:  # close() at shutdown: the Jobs held here end like queued ones
            for job in jobs:
                job.settle(exc=NotReady("the server shut down before this image was encoded"))
            raise
        except Exception:  # a bug here must not strand the Jobs: encode them locally
            log.exception("shared cache lookup failed; encoding locally")
            self._dispatch_misses(jobs, dispatch)

    async def _lookup(self, job: Job) -> str:
        """'hit' (settled), 'miss' (this replica encodes) or 'leased_elsewhere' (another one does)."""
        key = KEY_PREFIX + job.key
        hit = await self.get(key)
        if hit is not None:
            self._settle(job, hit)
            return "hit"
        if job.future.done() or await self._take_lease(job.key):
            return "miss"
        return "leased_elsewhere"

    async def _wait_for(self, job: Job, dispatch: Callable[[list[Job]], None]) -> None:
        end = time.monotonic() + min(self.lease_s, job.deadline - time.monotonic())
        key, lease = KEY_PREFIX + job.key, LEASE_PREFIX + job.key
        while time.monotonic() < end and not job.future.done():
            await asyncio.sleep(self.poll_s)
            try:
                value, holder = await self._redis.mget([key, lease])
            except RedisError as exc:
                self._failed(exc)
                break
            self._ok()
            if value is not None:
                hit = await self._decode(key, value)
                if hit is not None:
                    self.metrics.cache_leases_total.labels(outcome="joined").inc()
                    self._settle(job, hit)
                    return
            if holder is None:  # the holder finished without a value (failed) or died
                break
        if job.future.done():  # every request waiting for it went away
            return
        self.metrics.cache_leases_total.labels(outcome="expired").inc()
        self._dispatch_misses([job], dispatch)

    def _settle(self, job: Job, hit: EncodedImage) -> None:
        job.from_shared = True
        job.settle(result=hit)

    def _dispatch_misses(self, jobs: list[Job], dispatch: Callable[[list[Job]], None]) -> None:
        live = [job for job in jobs if not job.future.done()]  # requests that left cancelled the others
        for job in live:
            job.future.add_done_callback(functools.partial(self._encoded, job.key))
        if live:
            dispatch(live)

    def _encoded(self, key: str, future: asyncio.Future[EncodedImage]) -> None:
        """An encode this replica ran finished: store it (on success) and give up the lease."""
        result = None if future.cancelled() or future.exception() is not None else future.result()
        self._spawn(self._store(key, result))

    async def _store(self, key: str, result: EncodedImage | None) -> None:
        if result is not None:
            await self.put(KEY_PREFIX + key, result)
        try:
            await self._release(keys=[LEASE_PREFIX + key], args=[self._token])
        except RedisError as exc:
            self._failed(exc)

    async def _take_lease(self, key: str) -> bool:
        """True when this replica should encode: it took the lease, or Redis cannot say."""
        if self._skipping():
            return True
        try:
            taken = await self._redis.set(
                LEASE_PREFIX + key, self._token, nx=True, px=int(self.lease_s * 1000)
            )
        except RedisError as exc:
            self._failed(exc)
            return True
        self._ok()
        if taken:
            self.metrics.cache_leases_total.labels(outcome="taken").inc()
        return bool(taken)

    # ------------------------------------------------------------------------------- get / put

    async def get(self, key: str) -> EncodedImage | None:
        """The entry under `key`, or None (a miss, a corrupt value, or Redis out: see the metrics)."""
        if self._skipping():
            return None
        try:
            value = await self._redis.get(key)
        except RedisError as exc:
            self._failed(exc)
            return None
        self._ok()
        hit = None if value is None else await self._decode(key, value)
        if hit is None:
            self.metrics.cache_misses_total.labels(layer=SHARED).inc()
        return hit

    async def put(self, key: str, encoded: EncodedImage) -> None:
        if self._skipping():
            return
        value = await _off_loop(encode_entry, encoded, entry_nbytes(encoded))
        try:
            await self._redis.set(key, value, px=self._ttl_ms)
        except RedisError as exc:
            self._failed(exc)
            return
        self._ok(wrote=True)
        self.metrics.cache_written_bytes_total.labels(layer=SHARED).inc(len(value))

    async def _decode(self, key: str, value: bytes | str) -> EncodedImage | None:
        if isinstance(value, str):  # not with decode_responses=False (ours); typed so by redis-py
            value = value.encode()
        try:
            hit = await _off_loop(decode_entry, value, len(value))
        except EntryError as exc:
            self.metrics.cache_errors_total.labels(layer=SHARED, kind="corrupt").inc()
            log.warning("shared cache: deleting the unreadable value under %s: %s", key, exc)
            try:
                await self._redis.delete(key)
            except RedisError as err:
                self._failed(err)
            return None
        self.metrics.cache_hits_total.labels(layer=SHARED).inc()
        self.metrics.cache_read_bytes_total.labels(layer=SHARED).inc(len(value))
        return hit

    # ------------------------------------------------------------------------------- health

    def _skipping(self) -> bool:
        return time.monotonic() < self._skip_until

    def _failed(self, exc: RedisError) -> None:
        kind = _error_kind(exc)
        self.metrics.cache_errors_total.labels(layer=SHARED, kind=kind).inc()
        if kind == "full":
            if not self._full:
                log.warning(
                    "shared cache at %s refuses writes (%s): set maxmemory-policy allkeys-lru "
                    "(docs/cache.md); serving on, new entries stay local",
                    self.url,
                    exc,
                )
                self._full = True
            return
        if kind in ("unavailable", "timeout"):
            self._failures += 1
            self._skip_until = time.monotonic() + self._backoff.compute(self._failures)
        if not self._down:
            log.warning(
                "shared cache at %s is unavailable (%s); serving from the local path until it is back",
                self.url,
                exc,
            )
            self._down = True

    def _ok(self, *, wrote: bool = False) -> None:
        self._failures = 0
        if self._down:
            log.info("shared cache at %s is back", self.url)
            self._down = False
        if wrote and self._full:
            log.info("shared cache at %s accepts writes again", self.url)
            self._full = False

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _error_kind(exc: RedisError) -> str:
    if isinstance(exc, RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError):
        return "unavailable"
    if isinstance(exc, OutOfMemoryError):  # maxmemory reached under noeviction
        return "full"
    return "other"


async def _off_loop(fn: Callable[[Any], T], arg: Any, size: int) -> T:
    if size <= INLINE_BYTES:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)
