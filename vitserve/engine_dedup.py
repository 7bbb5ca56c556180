"""Never encode the same image twice: the encoder-output cache and in-flight deduplication for the engine.

For each image of a request, Engine.encode asks the WorkTable for a Slot:
  1. a cache hit (--cache_gb > 0): the stored EncodedImage; no queue, no encoder;
  2. an image with the same key already queued or being encoded (by this or another request): the
     request joins that WorkItem (refcounted) and awaits its future through asyncio.shield (in
     Engine._complete), so one waiter's cancellation or timeout never cancels the encode the others
     still wait for;
  3. otherwise a new WorkItem, which the engine enqueues.
The queued WorkItem is cancelled only when its last waiter leaves. A successful encode is stored in the
cache. Deduplication runs with --cache_gb 0 too: it costs one dict lookup per image.

The key is the image bytes' sha256 (the API's image_id) plus the configuration fingerprint
(vitserve/cache.py), set once the ranks reported their model, dtype and device. An image_id that is not
a sha256 hex digest (a caller's own label) says nothing about the content, so such an image is always
encoded on its own. Everything here runs on the engine's event loop thread and never awaits between
reading and updating the table, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vitserve.cache import EmbeddingCache, cache_fingerprint, cache_key
from vitserve.config import Config
from vitserve.engine_dispatch import Dispatcher, WorkItem
from vitserve.types import EncodedImage, ProcessedImage


@dataclass(eq=False)
class SharedWork:
    """One WorkItem awaited by `waiters` images (of one or more requests)."""

    key: str
    work: WorkItem
    waiters: int = 0


@dataclass(eq=False)
class Slot:
    """What one image of a request waits on: a cached result, or a (possibly shared) WorkItem."""

    item: ProcessedImage  # this request's own processed image (its grid goes to the LLM)
    cached: EncodedImage | None = None  # a cache hit
    shared: SharedWork | None = None
    fresh: bool = False  # this slot created the WorkItem (the engine must enqueue it)

    @property
    def reused(self) -> bool:
        """True when this request did not cause the encode (cache hit or joined another encode)."""
        return not self.fresh

    @property
    def future(self) -> asyncio.Future[EncodedImage]:
        """The encode this image waits for. Await it through asyncio.shield: other requests may share it."""
        assert self.shared is not None, "a cache hit, or the slot was released"
        return self.shared.work.future

    @property
    def timing(self) -> tuple[float, float]:
        """(queue_s, encode_s) of the encode this image waited for; zero for a cache hit."""
        if self.shared is None:
            return 0.0, 0.0
        return self.shared.work.queue_s, self.shared.work.encode_s


class WorkTable:
    def __init__(self, dispatch: Dispatcher, cache: EmbeddingCache | None):
        self.dispatch = dispatch
        self.cache = cache
        self.fingerprint = ""  # set by set_fingerprint() once the ranks are ready
        self._inflight: dict[str, SharedWork] = {}
        self._ids = itertools.count()

    def set_fingerprint(self, config: Config, processor_clamp: Mapping[str, Any] | None, info: Mapping[str, Any],
                        device: str | None) -> None:
        self.fingerprint = cache_fingerprint(config, processor_clamp, model_name=info.get("model"),
                                             family=info.get("family"), dtype=info.get("dtype"), device=device)

    @property
    def inflight_keys(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------------------------ acquire / release

    def acquire(self, items: list[ProcessedImage], image_ids: list[str], deadline: float) -> list[Slot]:
        """One slot per image, in order. Fresh WorkItems are created but not enqueued (see fresh_works)."""
        return [self._slot(item, image_id, deadline)
                for item, image_id in zip(items, image_ids, strict=True)]

    def _slot(self, item: ProcessedImage, image_id: str, deadline: float) -> Slot:
        if not is_content_id(image_id):
            return Slot(item, shared=SharedWork("", self._new_work(item, deadline), waiters=1), fresh=True)
        key = cache_key(self.fingerprint, image_id)
        shared = self._inflight.get(key)
        if shared is not None and _failed(shared.work.future):
            shared = None  # failed a moment ago (its done callback has not run yet): encode anew
        if shared is None and self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return Slot(item, cached=hit)
        fresh = shared is None
        if shared is None:
            work = self._new_work(item, deadline)
            shared = self._inflight[key] = SharedWork(key, work)
            work.future.add_done_callback(functools.partial(self._on_done, shared))
        # the queued item lives as long as its most patient waiter
        shared.work.deadline = max(shared.work.deadline, deadline)
        shared.waiters += 1
        return Slot(item, shared=shared, fresh=fresh)

    def _new_work(self, item: ProcessedImage, deadline: float) -> WorkItem:
        return WorkItem(id=next(self._ids), item=item, deadline=deadline,
                        future=asyncio.get_running_loop().create_future())

    @staticmethod
    def fresh_works(slots: list[Slot]) -> list[WorkItem]:
        return [s.shared.work for s in slots if s.fresh and s.shared is not None]

    def release(self, slots: list[Slot]) -> None:
        """The request is done (result, error, timeout or cancellation): drop its claims; an encode that
        nobody waits for any more is removed from the queue (or its in-flight result dropped)."""
        for s in slots:
            shared = s.shared
            if shared is None:
                continue
            s.shared = None  # release is idempotent per slot
            shared.waiters -= 1
            if shared.waiters == 0:
                if self._inflight.get(shared.key) is shared:
                    del self._inflight[shared.key]
                self.dispatch.cancel([shared.work])  # no-op when done; marks a failure as retrieved

    def _on_done(self, shared: SharedWork, _future: asyncio.Future[EncodedImage] | None = None) -> None:
        if self._inflight.get(shared.key) is shared:
            del self._inflight[shared.key]  # a later request makes a new WorkItem (or hits the cache)
        future = shared.work.future
        if self.cache is not None and not future.cancelled() and future.exception() is None:
            self.cache.put(shared.key, future.result())


def is_content_id(image_id: str) -> bool:
    """True for a sha256 hex digest (what the API sends), the only ids that identify an image's content."""
    return len(image_id) == 64 and all(c in _HEX for c in image_id)


_HEX = frozenset("0123456789abcdef")


def _failed(future: asyncio.Future[EncodedImage]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
