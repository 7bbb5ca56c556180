"""A video's temporal groups into the queue a chunk at a time, their pixels made as they go (docs/video.md
"Memory").

A PreparedVideo with a feed arrives with its groups' ids and token counts but no pixels. Engine.encode
claims every group first (cache hits and groups another request is encoding need no pixels), then starts
one task (feed_groups) for the groups this request must encode. The task asks the feed for one chunk's
pixels, adds the chunk as a stream (Scheduler.add_stream: the fairness window holds within it) once the
chunk before it left the queue, then asks for the next chunk while this one waits in the queue. So at most
about three chunks of a video are in memory (one encoding per encoder group, one queued, one being made),
and a group's pixels are dropped once it is encoded.

The task belongs to the groups, not to the request that made them: a later request may join a group, so
the task runs until every group it feeds is settled (encoded, failed, or cancelled because no request
waits for it any more) or fed. A feed error (a frame that does not decode) settles every group it has not
fed with that error, which fails each request waiting on them; groups already queued are cancelled by
their requests' release as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from vitserve.contract import GroupFeed
from vitserve.engine.jobs import Job
from vitserve.errors import NotReady, VitserveError

_NO_PIXELS = torch.empty(0)


async def feed_groups(feed: GroupFeed, jobs: list[tuple[int, Job]], add: Callable[[list[Job]], None]) -> None:
    """Fill and queue ``jobs`` = (group index, Job) in time order, a chunk at a time (see the module doc)."""
    try:
        await _feed(feed, jobs, add)
    except asyncio.CancelledError:  # the engine is shutting down
        _settle_unfed(jobs, NotReady("the server shut down before this video was encoded"))
        raise
    except Exception as exc:
        error = exc if isinstance(exc, VitserveError) else VitserveError(f"the video feed failed: {exc!r}")
        _settle_unfed(jobs, error)


def _settle_unfed(jobs: list[tuple[int, Job]], error: VitserveError) -> None:
    for _, job in jobs:
        if not job.fed:  # never fed: nobody else will settle it
            job.settle(exc=error)


async def _feed(feed: GroupFeed, jobs: list[tuple[int, Job]], add: Callable[[list[Job]], None]) -> None:
    size = max(1, feed.chunk_groups)
    chunks = [jobs[k : k + size] for k in range(0, len(jobs), size)]
    previous: list[Job] = []
    making: asyncio.Future[list[torch.Tensor]] | None = None
    try:
        for k, chunk in enumerate(chunks):
            pixels = await (making or _make(feed, chunk))
            making = None
            _fill(chunk, pixels)
            await _left_queue(previous)
            previous = [job for _, job in chunk if not job.future.done()]
            if previous:
                add(previous)
            rest = chunks[k + 1 :]
            if rest and _pending(rest):  # the next chunk is made while this one waits in the queue
                making = _make(feed, rest[0])
            if not _pending(rest):
                return  # nobody waits for the rest (cancelled, or joined and done): no more decoding
    finally:
        if making is not None:
            making.cancel()
            with contextlib.suppress(BaseException):
                await making


def _make(feed: GroupFeed, chunk: list[tuple[int, Job]]) -> asyncio.Future[list[torch.Tensor]]:
    return asyncio.ensure_future(feed.pixels([g for g, _ in chunk]))


def _fill(chunk: list[tuple[int, Job]], pixels: list[torch.Tensor]) -> None:
    for (_, job), values in zip(chunk, pixels, strict=True):
        # the Job's own item gets the pixels: the request's PreparedImage (frozen, shared) is never changed
        job.item = dataclasses.replace(job.item, pixel_values=values)
        job.fed = True
        job.future.add_done_callback(functools.partial(_drop_pixels, job))


def _pending(chunks: list[list[tuple[int, Job]]]) -> bool:
    """Some group of these chunks is still awaited."""
    return any(not job.future.done() for chunk in chunks for _, job in chunk)


async def _left_queue(jobs: list[Job]) -> None:
    """Until each of these jobs was sent to a group or settled."""
    for job in jobs:
        if job.sent.is_set() or job.future.done():
            continue
        sent: asyncio.Future[object] = asyncio.ensure_future(job.sent.wait())
        done: asyncio.Future[object] = job.future  # type: ignore[assignment]  # only awaited, never read
        try:
            await asyncio.wait([sent, done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            sent.cancel()


def _drop_pixels(job: Job, _future: object = None) -> None:
    """An encoded (or failed, or cancelled) group needs its pixels no more."""
    job.item = dataclasses.replace(job.item, pixel_values=_NO_PIXELS)
