"""The engine: what the HTTP front end calls (contract.Engine). Owns admission, Jobs, groups and the LLM push.

    engine = Engine(config, metrics, warmup_image=item)  # a small ProcessedImage (api/server.py warmup_image)
    config = await engine.start()                # spawn dp x tp ranks, wait for every READY + warm-up encode
    engine.admit(None)                           # the one queue rule; raises QueueFull with Retry-After
    results = await engine.encode(EncodeRequest(...))
    await engine.shutdown()                      # STOP, join, clean files

`start()` returns the Config to serve with: the flags' own, or with --visual_mem_gb alone the budget the
ranks chose (engine/startup.py `decided_config`, the one place it is decided); the queue opens with it, and
`engine.config` is it from then on (before, it is the flags' Config the ranks were spawned with).

This is the only module that calls both the JobTable (jobs.py) and the Dispatcher (dispatch.py): a new
Job goes to the dispatcher's queue, and the Jobs a request leaves orphaned go to `dispatch.cancel`.
`engine.failed` (asyncio.Event) is set when no encoder group is left (every rank of every group died or
hung): from then on admit() raises EncoderFailed, and the Service exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.contract import (
    EncodeRequest,
    EngineInfo,
    ItemResult,
    ProcessedImage,
    Readiness,
    RequestItem,
)
from vitserve.engine.collect import collect
from vitserve.engine.dispatch import Dispatcher
from vitserve.engine.feed import feed_groups
from vitserve.engine.groups import TERM_GRACE_S, GroupState, Watchdog, WorkerGroup
from vitserve.engine.jobs import Claim, Job, JobTable
from vitserve.engine.local_cache import make_cache
from vitserve.engine.push import LLMPush
from vitserve.engine.startup import decided_config, wait_ready
from vitserve.errors import EncoderFailed, NotReady, QueueFull
from vitserve.metrics import Metrics
from vitserve.model.base import Encoder
from vitserve.transport_specs import spec_of
from vitserve.worker import rendezvous
from vitserve.worker.args import load_configured_encoder
from vitserve.worker.rendezvous import Rendezvous
from vitserve.worker.reservation import StressShape
from vitserve.worker.reservation.published import remove_killed

if TYPE_CHECKING:
    from vitserve.engine.shared_cache import SharedCache

log = logging.getLogger(__name__)
GroupFactory = Callable[..., WorkerGroup]  # WorkerGroup's constructor, or a test's in-process group


class Engine:
    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        encoder_factory: Callable[[Config], Encoder] | None = None,
        environ: Mapping[str, str] | None = None,
        checkpoint: Checkpoint | None = None,
        group_factory: GroupFactory = WorkerGroup,
        warmup_image: ProcessedImage | None = None,
        stress_shape: StressShape | None = None,
    ):
        """warmup_image: encoded once by every group before the group counts as ready (the CLI always gives
        one, so /ready means "every rank passed a real encode"); None: a group is ready at its READYs.
        checkpoint: --model as the CLI opened it; the default encoder factory loads it in every rank
        (None: opened here from the config).
        stress_shape: the worst case the ranks reserve for, with the image processor's per-image limits (the
        CLI builds it from the processor it loaded); None: from the flags alone (StressShape.of)."""
        self.config = config
        self.metrics = metrics
        self.warmup_image = warmup_image
        # More conditions of readiness, each a callable returning None when fine or the reason it is not
        # (e.g. "the LLM receiver at ... is not reachable"); readiness() reports the first failing one.
        self.readiness_checks: list[Callable[[], str | None]] = []
        if encoder_factory is None:
            checkpoint = checkpoint or Checkpoint.open(self.config.model, self.config.model_family)
            encoder_factory = functools.partial(load_configured_encoder, checkpoint)  # pickled to each rank
        self.encoder_factory = encoder_factory
        self.stress_shape = stress_shape or StressShape.of(config)
        self._group_factory = group_factory
        # where each group's ranks meet: the config, else torchrun's env (read here, once), else one host
        self._environ = dict(os.environ if environ is None else environ)
        self._init_state()

    def _init_state(self) -> None:
        self._dispatch = Dispatcher(self.metrics, self.warmup_image)
        self.failed = self._dispatch.all_failed  # set when no encoder group is left
        self._jobs = JobTable(make_cache(self.config, self.metrics))  # cache + dedup
        self._started = False
        self._stopping = False  # shutdown() began: admit() refuses, readiness() says so
        self._closed = False  # torn down (after shutdown() or a failed start())
        self._tasks: list[asyncio.Task[None]] = []
        self._feeds: set[asyncio.Future[None]] = set()  # videos' feed tasks (engine/feed.py)
        self._ipc_dir: str | None = None
        self._push: LLMPush | None = None  # once started with --llm_endpoint
        self._shared: SharedCache | None = None  # once started with --cache_url

    # ------------------------------------------------------------------------------------ start / stop

    async def start(self) -> Config:
        """Spawn dp x tp ranks; once every group is ready (its ranks' READYs, then the warm-up encode), open
        the queue with the Config their start-up decided (engine/startup.py decided_config) and return it:
        the Service builds its image processor and app from it."""
        # first: a bad --llm_endpoint fails before any rank is spawned; a transport that owns it (its peer is
        # vitserve's vLLM connector) pushes there itself (vitserve/transport_specs.py)
        if self.config.llm_endpoint and not spec_of(self.config).owns_llm_endpoint:
            self._push = LLMPush(self.config.llm_endpoint, self.metrics)
            self.readiness_checks.append(self._llm_receiver_check)
        self._ipc_dir = tempfile.mkdtemp(prefix="vitserve-")  # 0700: only this user reaches the sockets
        self._open_sockets()
        groups = self._dispatch.groups
        for g in range(self.config.dp):
            groups.append(
                self._group_factory(
                    g,
                    self.config,
                    self.encoder_factory,
                    ctx=self._sync_zmq,
                    ipc_dir=self._ipc_dir,
                    status_endpoint=self._status_endpoint,
                    rendezvous=self._rendezvous(g),
                    stress_shape=self.stress_shape,
                )
            )
        self._watchdog = Watchdog(groups, self.config.heartbeat_s, self._dispatch.fail_group)
        self._tasks = [
            asyncio.create_task(self._dispatch.read_status(self._status), name="vitserve-status"),
            asyncio.create_task(self._watchdog.run(), name="vitserve-watchdog"),
        ]
        for group in groups:
            group.spawn()
        try:
            await wait_ready(groups, self.config)
        except BaseException:
            await self._teardown()
            raise
        self.config = decided_config(self.config, groups)  # the flags' Config, or it with the chosen budget
        self._dispatch.open(self.config)
        info = self.info()
        if self._push is not None:
            self._push.model = info.model  # known once the ranks loaded it
        rank0 = groups[0].ready[0]  # it hashed the weights while it read them
        self._jobs.set_fingerprint(self.config, info, rank0.device, rank0.weights_digest)
        if self.config.cache_url is not None:  # imported only then: the shared layer needs the `redis` extra
            from vitserve.engine.shared_cache import open_shared_cache

            self._shared = await open_shared_cache(self.config, self.metrics)
        self._started = True
        return self.config

    def _open_sockets(self) -> None:
        self._zmq = zmq.asyncio.Context()
        self._sync_zmq = zmq.Context()
        self._status = self._zmq.socket(zmq.PULL)
        self._status.setsockopt(zmq.LINGER, 0)
        self._status_endpoint = f"ipc://{self._ipc_dir}/status"
        self._status.bind(self._status_endpoint)

    def _rendezvous(self, group: int) -> Rendezvous:
        assert self._ipc_dir is not None
        return rendezvous.resolve(self.config, self._environ, group=group, private_dir=self._ipc_dir)

    async def shutdown(self) -> None:
        """Refuse new work and stop the ranks. The Service lets the active requests finish first (its
        drain); work still pending here fails with NotReady. Safe to call twice, after a failed start(),
        or without start()."""
        self._stopping = True
        if self._ipc_dir is None or self._closed:
            return
        stopping = [g for g in self._dispatch.groups if g.state is GroupState.READY]
        for group in stopping:
            group.stop()
        for group in stopping:
            if not await asyncio.to_thread(group.join, max(5.0, 2 * self.config.heartbeat_s)):
                log.warning("group %d did not stop cleanly; killing it", group.index)
        await self._teardown()

    async def _teardown(self) -> None:
        """Kill whatever still runs (no orphans), stop the tasks, remove sockets and reservation files."""
        if self._closed:
            return
        self._closed = True
        self._dispatch.fail_all(NotReady("the server shut down before this image was encoded"))
        for group in self._dispatch.groups:
            group.kill(grace_s=TERM_GRACE_S)
            remove_killed(self.config.runtime_dir, map(group.global_rank, range(self.config.tp)), group.pids)
        for task in [*self._tasks, *self._feeds]:
            task.cancel()
        for task in [*self._tasks, *self._feeds]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._push is not None:
            await asyncio.to_thread(self._push.close)
        if self._shared is not None:
            await self._shared.close()
        self._status.close(linger=0)
        self._dispatch.slots.close()
        self._zmq.term()
        self._sync_zmq.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self.metrics.workers_ready.set(0)

    # ------------------------------------------------------------------------------------ state

    def readiness(self) -> Readiness:
        """Ready when every group passed its warm-up encode, no group failed or went silent, and every
        readiness check passes."""
        if self._stopping:
            return Readiness(False, "shutting down")
        if not self._started:
            warming = any(g.state is GroupState.WARMING for g in self._dispatch.groups)
            if warming and not any(g.state is GroupState.STARTING for g in self._dispatch.groups):
                return Readiness(False, "encoder ranks are up; running the warm-up encode")
            return Readiness(False, "encoder ranks are starting (loading weights, reserving memory)")
        failed = [g.failure for g in self._dispatch.groups if g.state is GroupState.FAILED]
        if failed:
            return Readiness(False, "; ".join(f for f in failed if f))
        now = time.monotonic()
        for group in self._dispatch.groups:
            reason = self._watchdog.health(group, now)  # the watchdog's own verdict, before it acts on it
            if reason is not None:
                return Readiness(False, reason)
        for check in self.readiness_checks:
            reason = check()
            if reason is not None:
                return Readiness(False, reason)
        return Readiness(True, "ok")

    def _llm_receiver_check(self) -> str | None:
        """The wire (docs/wire.md): not ready while no LLM receiver is connected to --llm_endpoint."""
        if self._push is not None and not self._push.reachable:
            return f"no LLM receiver is connected at --llm_endpoint {self._push.endpoint}"
        return None

    def info(self) -> EngineInfo:
        groups = self._dispatch.groups
        if not any(len(g.ready) == len(self.config.node_ranks) for g in groups):  # this node's ranks
            raise NotReady("encoder ranks are still starting")
        readies = sorted((g.global_rank(r), msg) for g in groups for r, msg in g.ready.items())
        first = readies[0][1]
        return EngineInfo(
            model=first.model_name,
            family=first.family,
            embed_dim=first.embed_dim,
            dtype=first.dtype,
            tp=self.config.tp,
            dp=self.config.dp,
            reserved_memory_bytes={rank: msg.reserved_bytes for rank, msg in readies},
            reserved_source=first.reserved_source,
            fingerprint=self._jobs.fingerprint,
            sizing=first.sizing,
        )

    # -------------------------------------------------------------------- views for the CLI and tests

    @property
    def jobs(self) -> JobTable:
        """The cache and the in-flight Jobs (read it; only Engine.encode changes it)."""
        return self._jobs

    @property
    def queue_tokens(self) -> int:
        queue = self._dispatch.scheduler
        return queue.queued_tokens if queue is not None else 0

    @property
    def queue_items(self) -> int:
        queue = self._dispatch.scheduler
        return queue.queued_items if queue is not None else 0

    @property
    def llm_messages_sent(self) -> int:
        """Embedding messages handed to --llm_endpoint so far (0 without one)."""
        return self._push.sent if self._push is not None else 0

    def groups(self) -> list[dict[str, Any]]:
        """Per encoder group: {"group", "state" (starting|warming|ready|failed|stopped), "failure", "pids"}."""
        return [
            {"group": g.index, "state": g.state.value, "failure": g.failure, "pids": g.pids}
            for g in self._dispatch.groups
        ]

    def worker_pids(self) -> dict[int, list[int]]:
        """Group index -> pids of its ranks (for the CLI's logs and for fault tests)."""
        return {g.index: g.pids for g in self._dispatch.groups}

    # ------------------------------------------------------------------------------------ encode

    def admit(self, tokens: int | None) -> None:
        """The one admission rule. `tokens` more queued tokens are refused when the queue already holds
        some and the sum would pass --max_queue_tokens; None (before decoding) counts as one token. An
        empty queue always admits, so one request larger than the limit is not refused forever, and
        0 tokens (every image a cache hit or already queued) always pass the queue check."""
        if self._stopping:
            raise NotReady("the server is shutting down and accepts no new requests")
        if self.failed.is_set():
            reasons = "; ".join(g.failure or "" for g in self._dispatch.groups)
            raise EncoderFailed(f"no encoder group is left to serve: {reasons}")
        if not self._started:
            raise NotReady("encoder ranks are still starting")
        limit, queued = self.config.queue_token_limit, self.queue_tokens
        adding = 1 if tokens is None else tokens
        if limit is not None and queued and adding and queued + adding > limit:
            more = "" if tokens is None else f" and this request adds {tokens}"
            raise QueueFull(
                f"{queued} tokens are queued{more}, above --max_queue_tokens {limit}",
                retry_after_s=self._retry_after_s(queued),
            )

    def _retry_after_s(self, queued: int) -> float:
        rate = self._dispatch.tokens_per_s
        return float(min(60, max(1, math.ceil(queued / rate)))) if rate > 0 else 1.0

    async def encode(self, request: EncodeRequest) -> list[ItemResult | None]:
        """Encode `request.items` and push each to the LLM in that order; cache hits, items queued or encoding
        (same sha256 id) and items handed over already are not encoded again."""
        self.admit(0)  # refuses when stopping, failed or starting, before any item is claimed
        todo = [(item, item.prepared) for item in request.items if item.prepared is not None]
        claims = self._jobs.claim([prepared for _, prepared in todo], request.deadline)
        try:  # only new Jobs count against the limit
            self.admit(sum(job.item.num_tokens for job in self._jobs.new_jobs(claims)))
            self._queue(request, [item for item, _ in todo], claims)
            return await collect(request, claims, self._push, self.metrics, self._release)
        finally:  # result, error, timeout or disconnect: Jobs nobody else claims leave the queue
            self._dispatch.cancel(self._jobs.release(claims))

    def _queue(self, request: EncodeRequest, items: list[RequestItem], claims: list[Claim]) -> None:
        """New Jobs into the queue: images' at once, each video's groups as a stream (fair: scheduler.py)."""
        new = [(i, c.job) for i, c in zip(items, claims, strict=True) if c.fresh and c.job is not None]
        self._submit([job for i, job in new if i.group is None], self._dispatch.add)
        stream = functools.partial(self._submit, add=self._dispatch.add_stream)
        for v, video in enumerate(request.videos):
            fed = [(i.group, job) for i, job in new if i.group is not None and i.media_index == v]
            if video.feed is None:
                stream([job for _, job in fed])
            else:
                self._start_feed(feed_groups(video.feed, fed, stream))

    def _release(self, claim: Claim) -> None:
        """One collected claim let go (JobTable.release is idempotent: the request's final release skips it)."""
        self._dispatch.cancel(self._jobs.release([claim]))

    def _submit(self, jobs: list[Job], add: Callable[[list[Job]], None]) -> None:
        """New Jobs to the dispatcher's `add`; with --cache_url the shared layer serves them or dispatches them."""
        if self._shared is None:
            add(jobs)
        else:
            self._shared.submit(jobs, add)

    def _start_feed(self, work: Coroutine[Any, Any, None]) -> None:
        """A video's feed runs as its own task: groups may outlive the request that made them."""
        task = asyncio.ensure_future(work)
        self._feeds.add(task)
        task.add_done_callback(self._feeds.discard)
