"""Never encode the same item twice: one Job per unique item, one Claim per request item, the cache.

An item is an image or a video's temporal group (contract.RequestItem). For each item of a request still to
hand over, Engine.encode asks the JobTable for a Claim:
  1. a cache hit (--cache_gb > 0): the stored EncodedImage; no queue, no encoder;
  2. an item with the same key already queued or being encoded (by this or another request): the
     claim joins that Job (refcounted) and awaits its future through asyncio.shield (in engine/collect.py),
     so one request's cancellation or timeout never cancels the encode the others still wait for;
  3. otherwise a new Job, which the engine hands to the dispatcher.
`release()` drops a request's claims and returns the Jobs nobody claims any more; the engine tells the
dispatcher to cancel them (this module imports no dispatcher). A successful encode is stored in the
cache. Deduplication runs with --cache_gb 0 too: it costs one dict lookup per item.

The key is the item's content id (the API's image_id: an image's bytes' sha256, a group's id) plus the configuration fingerprint
(engine/local_cache.py), set once the ranks reported their model, dtype and device. An image_id that is not
a sha256 hex digest (a caller's own label) says nothing about the content, so such an item is always
encoded on its own. Everything here runs on the engine's event loop thread and never awaits between
reading and updating the table, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vitserve.config import Config
from vitserve.contract import EncodedImage, EngineInfo, PreparedImage, ProcessedImage
from vitserve.engine.local_cache import EmbeddingCache, cache_fingerprint, cache_key


@dataclass(eq=False)
class Job:
    """One encode of one unique item (an image or a video group), from its creation until its future completes."""

    id: int
    key: str  # cache key; "" for an item without a content id (never shared, never cached)
    item: ProcessedImage
    deadline: float  # time.monotonic() based: the latest deadline of the requests claiming it
    future: asyncio.Future[EncodedImage]  # or a VitserveError
    claims: int = 0  # request items waiting on it
    enqueued_at: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0  # enqueue -> dispatch
    encode_s: float = 0.0  # dispatch -> result (the whole batch)
    from_shared: bool = False  # settled from the shared cache (engine/shared_cache.py), not encoded here
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # set when it left the queue for a group
    fed: bool = False  # a video group's pixels arrived from its feed (engine/feed.py); unused for images

    def settle(self, *, result: EncodedImage | None = None, exc: Exception | None = None) -> bool:
        """Complete the future once; False when it was already done (e.g. cancelled)."""
        if self.future.done():
            return False
        if exc is not None:
            self.future.set_exception(exc)
        else:
            assert result is not None, "a Job is settled with a result or an exception"
            self.future.set_result(result)
        return True

    @property
    def failed(self) -> bool:
        return self.future.done() and (self.future.cancelled() or self.future.exception() is not None)


@dataclass(eq=False)
class Claim:
    """One request item's hold on a cache hit or on a (possibly shared) Job."""

    prepared: PreparedImage  # this request's own image or group (its grid goes to the LLM)
    cached: EncodedImage | None = None  # a cache hit
    job: Job | None = None  # None for a cache hit, and once released
    fresh: bool = False  # this claim created the Job (the engine must queue it)

    @property
    def reused(self) -> bool:
        """True when this request did not cause the encode (cache hit, joined another encode, or the
        shared cache had it)."""
        return not self.fresh or (self.job is not None and self.job.from_shared)

    @property
    def timing(self) -> tuple[float, float]:
        """(queue_s, encode_s) of the encode this item waited for; zero for a cache hit."""
        if self.job is None:
            return 0.0, 0.0
        return self.job.queue_s, self.job.encode_s


class JobTable:
    def __init__(self, cache: EmbeddingCache | None):
        self.cache = cache
        self.fingerprint = ""  # set by set_fingerprint() once the ranks are ready
        self._jobs: dict[str, Job] = {}  # key -> the Job queued or encoding for it
        self._ids = itertools.count()

    def set_fingerprint(self, config: Config, info: EngineInfo, device: str | None, weights: str) -> None:
        """weights: the content digest rank 0 reported with its READY."""
        self.fingerprint = cache_fingerprint(
            config,
            model_name=info.model,
            family=info.family,
            dtype=info.dtype,
            device=device,
            weights=weights,
        )

    def __len__(self) -> int:
        """Unique items queued or encoding."""
        return len(self._jobs)

    def job(self, image_id: str) -> Job | None:
        """The Job queued or encoding for this item's id, if any."""
        return self._jobs.get(cache_key(self.fingerprint, image_id))

    # ------------------------------------------------------------------------------------ claim / release

    def claim(self, items: Sequence[PreparedImage], deadline: float) -> list[Claim]:
        """One claim per item (an image, or a video group as an image), in order. New Jobs are created but
        not queued (see new_jobs)."""
        return [self._claim(prepared, deadline) for prepared in items]

    def _claim(self, prepared: PreparedImage, deadline: float) -> Claim:
        if not is_content_id(prepared.image_id):
            return Claim(prepared, job=self._new_job("", prepared.item, deadline), fresh=True)
        key = cache_key(self.fingerprint, prepared.image_id)
        job = self._jobs.get(key)
        if job is not None and job.failed:
            job = None  # failed a moment ago (its done callback has not run yet): encode anew
        if job is None and self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return Claim(prepared, cached=hit)
        fresh = job is None
        if job is None:
            job = self._jobs[key] = self._new_job(key, prepared.item, deadline)
            job.future.add_done_callback(functools.partial(self._on_done, job))
        else:
            job.claims += 1
            job.deadline = max(
                job.deadline, deadline
            )  # the queued job lives as long as its most patient claim
        return Claim(prepared, job=job, fresh=fresh)

    def _new_job(self, key: str, item: ProcessedImage, deadline: float) -> Job:
        return Job(
            id=next(self._ids),
            key=key,
            item=item,
            deadline=deadline,
            claims=1,
            future=asyncio.get_running_loop().create_future(),
        )

    @staticmethod
    def new_jobs(claims: list[Claim]) -> list[Job]:
        return [c.job for c in claims if c.fresh and c.job is not None]

    def release(self, claims: list[Claim]) -> list[Job]:
        """The request is done (result, error, timeout or cancellation): drop its claims. Returns the Jobs
        nobody claims any more, for the dispatcher to cancel (a no-op for a Job already done)."""
        orphans = []
        for c in claims:
            job = c.job
            if job is None:
                continue
            c.job = None  # release is idempotent per claim
            job.claims -= 1
            if job.claims == 0:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                orphans.append(job)
        return orphans

    def _on_done(self, job: Job, _future: asyncio.Future[EncodedImage] | None = None) -> None:
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]  # a later request makes a new Job (or hits the cache)
        future = job.future
        if self.cache is not None and not future.cancelled() and future.exception() is None:
            self.cache.put(job.key, future.result())


def is_content_id(image_id: str) -> bool:
    """True for a sha256 hex digest (what the API sends), the only ids that identify an item's content."""
    return len(image_id) == 64 and all(c in _HEX for c in image_id)


_HEX = frozenset("0123456789abcdef")
