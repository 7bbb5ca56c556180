"""Queue -> idle group, RESULT/ERROR -> Jobs, faults -> errors: the engine's half that talks to groups.

Runs entirely on the API process's event loop (one thread), so the scheduler and the tables below need
no locks. Groups PULL: whenever a group is idle, it gets the next batch from the head of the one shared
FIFO queue, so the least busy group takes the work and at most one batch is in flight per group. The
group itself (engine/groups.py) holds that batch and changes its own state; this module only decides.

The warm-up encode: once every rank of a group reported READY, the group gets one small real image (the
`warmup` item the API's processor made) as a batch of its own, through the same batch socket, rank loop,
forward and RESULT as any request; only a result of the right shape, all finite, makes the group READY.
It bypasses the shared queue (each group must get its own) and every metric (no request asked for it).
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from vitserve.config import Config
from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.engine.groups import Batch, GroupState, WorkerGroup
from vitserve.engine.jobs import Job
from vitserve.engine.scheduler import Scheduler
from vitserve.errors import EncoderFailed, Timeout
from vitserve.metrics import Metrics
from vitserve.worker import messages as m
from vitserve.worker.slots import ResultSlots, slot_bytes

log = logging.getLogger(__name__)
ERROR_GRACE_S = 0.2  # collect the other ranks' errors before failing a group (root cause first)


class Dispatcher:
    def __init__(self, metrics: Metrics, warmup: ProcessedImage | None = None):
        self.metrics = metrics
        self.warmup = warmup  # each group encodes it once before it counts as READY; None: no warm-up
        # built by open() from the Config the ranks' start-up decided (engine/startup.py decided_config):
        # until then the groups start and warm up, and nothing is queued
        self.scheduler: Scheduler | None = None
        self.groups: list[WorkerGroup] = []
        self.queued: dict[int, Job] = {}  # job id -> Job, for the ids the scheduler hands back
        self.all_failed = asyncio.Event()  # set when no group is left to serve
        self.tokens_per_s = 0.0  # EWMA of encode throughput, for Retry-After
        self.slots = ResultSlots()  # shared memory rank 0s write results into (worker/slots.py)
        self._batch_ids = 0

    def open(self, config: Config) -> None:
        """The queue, with the decided budget (Engine.start, once every group is ready)."""
        assert self.scheduler is None, "the queue opens once"
        self.scheduler = Scheduler(config.visual_batch_max_tokens, config.visual_infer_batch_size)

    @property
    def _queue(self) -> Scheduler:
        assert self.scheduler is not None, "no work is queued before the engine has started"
        return self.scheduler

    # ------------------------------------------------------------------------------------ queue

    def add(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queue.add(job.id, job.item.num_tokens)
            self.queued[job.id] = job
        self._update_queue_gauges()
        self.dispatch()

    def add_stream(self, jobs: list[Job]) -> None:
        """A video's temporal groups, in order: one batch's worth enters the queue now, the rest as those
        are dispatched (Scheduler.add_stream)."""
        self._queue.add_stream([(job.id, job.item.num_tokens) for job in jobs])
        for job in jobs:
            self.queued[job.id] = job
        self._update_queue_gauges()
        self.dispatch()

    def cancel(self, jobs: list[Job]) -> None:
        """Forget Jobs nobody waits for: queued ones never reach a group, in-flight results are dropped."""
        for job in jobs:
            if self.scheduler is not None and self.scheduler.cancel(job.id):
                self.queued.pop(job.id, None)
            if not job.future.done():
                job.future.cancel()  # an in-flight result for it is dropped on arrival
            elif not job.future.cancelled():
                job.future.exception()  # mark a failure nobody awaited as seen (no "never retrieved" noise)
        self._update_queue_gauges()

    def dispatch(self) -> None:
        """Give every idle group the next batch from the head of the queue (none before open)."""
        if self.scheduler is None:
            return
        for group in self.groups:
            if not group.idle:
                continue
            jobs = self._next_jobs()
            if not jobs:
                return
            self._send_batch(group, jobs)

    def _next_jobs(self) -> list[Job]:
        now = time.monotonic()
        while (ids := self._queue.next_batch()) is not None:
            live = []
            for job in (self.queued.pop(i) for i in ids):  # type: ignore[call-overload]  # ids are our ints
                if job.deadline <= now:  # past --request_timeout_s while queued: dropped, never encoded
                    job.settle(exc=Timeout("the image waited in the queue past --request_timeout_s"))
                else:
                    live.append(job)
            if live:
                return live
        return []

    def _send_batch(self, group: WorkerGroup, jobs: list[Job]) -> None:
        self._batch_ids += 1
        batch = Batch(self._batch_ids, jobs, time.monotonic())
        for job in jobs:
            job.queue_s = batch.started - job.enqueued_at
            job.sent.set()
            self.metrics.stage_seconds.labels(stage="queue").observe(job.queue_s)
        self.metrics.batch_tokens.observe(batch.tokens)
        self.metrics.batch_images.observe(len(jobs))
        if budget := self._queue.visual_batch_max_tokens:
            self.metrics.batch_fill_ratio.observe(batch.tokens / budget)
        self._update_queue_gauges()
        self._lend(group, batch)
        try:
            group.start_batch(batch)
        except Exception as exc:  # zmq refused the batch: the group cannot take work
            self.slots.give_back(batch.slot)
            self.fail_group(group, f"could not hand a batch to group {group.index}: {exc}")

    def _lend(self, group: WorkerGroup, batch: Batch) -> None:
        """A result slot for the batch's outputs, where one is worth it and can be had (worker/slots.py)."""
        batch.slot = self.slots.lend(slot_bytes(group.result_sizes(batch)))

    def _update_queue_gauges(self) -> None:
        if self.scheduler is not None:
            self.metrics.queue_tokens.set(self.scheduler.queued_tokens)
            self.metrics.queue_images.set(self.scheduler.queued_items)

    # ------------------------------------------------------------------------------------ status socket

    async def read_status(self, sock: zmq.asyncio.Socket) -> None:
        """Every rank's READY / ALIVE / RESULT / ERROR; malformed frames are logged and dropped."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                msg = m.decode([f.buffer for f in frames], self.slots.buffers)
            except m.SlotError as exc:  # a result that cannot be read: its jobs fail, nothing waits forever
                self._on_lost_result(exc)
                continue
            except m.MessageError as exc:
                log.warning("dropped a malformed message on the status socket: %s", exc)
                continue
            try:
                self._on_message(msg)
            except Exception:  # a bug here must not stop the reader: every future would then hang
                log.exception("error while handling a %s message", msg.kind.value)

    def _on_message(self, msg: m.Message) -> None:
        group = self._group(getattr(msg, "group", -1))
        if group is None or not group.alive:
            return  # a late message from a group already torn down
        if isinstance(msg, m.AliveMsg):
            self.metrics.heartbeats_total.inc(group.on_alive(msg))
        elif isinstance(msg, m.ReadyMsg):
            self._on_ready(group, msg)
        elif isinstance(msg, m.ResultMsg):
            self._on_result(group, msg)
        elif isinstance(msg, m.ErrorMsg):
            self._on_error(group, msg)
        else:
            log.warning("dropped an unexpected %s message on the status socket", msg.kind.value)

    def _group(self, index: object) -> WorkerGroup | None:
        if isinstance(index, int) and 0 <= index < len(self.groups):
            return self.groups[index]
        return None

    def _on_ready(self, group: WorkerGroup, msg: m.ReadyMsg) -> None:
        rank = str(group.global_rank(msg.rank))
        self.metrics.reserved_memory_bytes.labels(rank=rank).set(msg.reserved_bytes)
        if not group.on_ready(msg):
            return
        batch = None
        if self.warmup is not None:
            self._batch_ids += 1
            batch = Batch(self._batch_ids, [], time.monotonic(), warmup=self.warmup)
            self._lend(group, batch)
        try:
            group.warm_up(batch)
        except Exception as exc:  # zmq refused the batch: the group cannot take work
            self.slots.give_back(batch.slot if batch is not None else "")
            self.fail_group(group, f"could not hand the warm-up encode to group {group.index}: {exc}")
            return
        if group.state is GroupState.READY:
            self._group_ready()

    def _group_ready(self) -> None:
        self._update_ready_gauge()
        self.dispatch()

    def _on_warmup(self, group: WorkerGroup, batch: Batch, outputs: list[EncodedImage]) -> None:
        assert batch.warmup is not None
        want = (batch.warmup.num_tokens, group.ready[0].embed_dim)
        got = tuple(outputs[0].embedding.shape) if len(outputs) == 1 else f"{len(outputs)} outputs"
        if got != want:
            self.fail_group(
                group, f"the warm-up encode of group {group.index} returned {got}, expected {want}"
            )
        elif not bool(outputs[0].embedding.isfinite().all()):
            self.fail_group(
                group, f"the warm-up encode of group {group.index} returned NaN or infinite values"
            )
        else:
            log.info(
                "encoder group %d passed its warm-up encode (%d tokens in %.2f s)",
                group.index,
                want[0],
                time.monotonic() - batch.started,
            )
            group.warmed()
            self._group_ready()

    def _on_result(self, group: WorkerGroup, msg: m.ResultMsg) -> None:
        batch = group.finish_batch(msg.batch_id)
        if batch is None:
            log.warning("dropped a result for unknown batch %d from group %d", msg.batch_id, group.index)
            return
        self.slots.give_back(batch.slot)  # the frames came instead (a slot its tensors use is held, not lent)
        if batch.warmup is not None:
            self._on_warmup(group, batch, msg.outputs)
            return
        seconds = time.monotonic() - batch.started
        self.metrics.stage_seconds.labels(stage="encode").observe(seconds)  # the ZMQ hops included
        self.metrics.stage_seconds.labels(stage="forward").observe(msg.forward_s)  # rank 0's own timer
        if seconds > 0:
            rate = batch.tokens / seconds
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * rate if self.tokens_per_s else rate
        if len(msg.outputs) != len(batch.jobs):
            self.fail_group(
                group, f"group {group.index} returned {len(msg.outputs)} outputs for {len(batch.jobs)} images"
            )
            return
        for job, out in zip(batch.jobs, msg.outputs, strict=True):
            job.encode_s = seconds
            if job.settle(result=out):
                self.metrics.images_total.labels(outcome="encoded").inc()
        self.dispatch()

    # ------------------------------------------------------------------------------------ faults

    def _on_lost_result(self, exc: m.SlotError) -> None:
        group = self._group(exc.group)
        batch = group.finish_batch(exc.batch_id) if group is not None and group.alive else None
        if group is None or batch is None:
            log.warning("dropped an unreadable result of an unknown batch: %s", exc)
            return
        self.slots.give_back(batch.slot)
        log.error("encoder group %d: %s", group.index, exc)
        if batch.warmup is not None:
            self.fail_group(group, f"the warm-up encode's result cannot be read: {exc}")
            return
        error = EncoderFailed(f"the encoder's result cannot be read: {exc}")
        for job in batch.jobs:
            job.settle(exc=error)
        self.dispatch()

    def _on_error(self, group: WorkerGroup, msg: m.ErrorMsg) -> None:
        """A rank failed. Its peers usually fail a moment later in the collective ("connection reset");
        wait a beat so the error names the root cause first, then fail the group."""
        where = f"batch {msg.batch_id}" if msg.batch_id >= 0 else msg.stage
        group.errors.append(f"rank {msg.rank} of group {group.index} failed ({where}): {msg.message}")
        if msg.setting and group.setting_error is None:
            group.setting_error = msg.message
        if len(group.errors) == 1:
            asyncio.get_running_loop().call_later(ERROR_GRACE_S, self.fail_group, group, None)

    def fail_group(self, group: WorkerGroup, reason: str | None) -> None:
        """Fail the group's in-flight work, tear it down (no orphans), and stop serving if none is left."""
        if not group.alive:
            return
        reason = "; ".join([*group.errors, *([reason] if reason else [])])  # reported errors first
        batch = group.fail(reason)
        if batch is not None:
            self.slots.retire(batch.slot)  # its rank may still write it while it is killed
            error = EncoderFailed(f"encoder group {group.index} failed: {reason}")
            for job in batch.jobs:
                job.settle(exc=error)
        self._update_ready_gauge()
        if not any(g.alive for g in self.groups):
            self._fail_queue(
                EncoderFailed(f"no encoder group is left; encoder group {group.index} failed: {reason}")
            )
            self.all_failed.set()
        else:
            self.dispatch()  # the surviving groups take the queue

    def fail_all(self, exc: Exception) -> None:
        """Settle every queued and in-flight Job with `exc` (the engine is going away)."""
        for group in self.groups:
            batch = group.finish_batch(group.batch.id) if group.batch is not None else None
            for job in batch.jobs if batch is not None else ():
                job.settle(exc=exc)
        self._fail_queue(exc)

    def _fail_queue(self, exc: Exception) -> None:
        for job in self.queued.values():
            self._queue.cancel(job.id)
            job.settle(exc=exc)
        self.queued.clear()
        self._update_queue_gauges()

    def _update_ready_gauge(self) -> None:
        ready = sum(len(g.ready) for g in self.groups if g.state is GroupState.READY)
        self.metrics.workers_ready.set(ready)
