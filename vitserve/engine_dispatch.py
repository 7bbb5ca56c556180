"""The engine's half that talks to encoder groups: queue -> idle group, results -> futures, faults -> errors.

Runs entirely on the API process's event loop (one thread), so the scheduler and the tables below need
no locks. Groups PULL: whenever a group is idle, it gets the next batch from the head of the one shared
FIFO queue, so the least busy group takes the work and at most one batch is in flight per group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from vitserve.config import Config
from vitserve.errors import EncoderFailed, Timeout
from vitserve.metrics import Metrics
from vitserve.parallel import messages as m
from vitserve.parallel.pool import GroupState, WorkerGroup
from vitserve.scheduler import Scheduler
from vitserve.types import EncodedImage, ProcessedImage

log = logging.getLogger(__name__)
ERROR_GRACE_S = 0.2  # collect the other ranks' errors before failing a group (root cause first)


@dataclass(eq=False)
class WorkItem:
    """One accepted image, from enqueue until its future completes."""

    id: int
    item: ProcessedImage
    deadline: float  # time.monotonic() based
    future: asyncio.Future[EncodedImage]  # or a VitserveError
    enqueued_at: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0  # enqueue -> dispatch
    encode_s: float = 0.0  # dispatch -> result (the whole batch)


class Dispatcher:
    def __init__(self, config: Config, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.scheduler = Scheduler(config.visual_batch_max_tokens, config.visual_infer_batch_size)
        self.groups: list[WorkerGroup] = []
        self.queued: dict[int, WorkItem] = {}
        self.inflight: dict[int, tuple[WorkerGroup, list[WorkItem], float]] = {}  # batch id -> (group, work, t0)
        self.all_failed = asyncio.Event()  # set when no group is left to serve
        self.tokens_per_s = 0.0  # EWMA of encode throughput, for Retry-After
        self._batch_ids = 0

    # ------------------------------------------------------------------------------------ queue

    def add(self, works: list[WorkItem]) -> None:
        for w in works:
            self.scheduler.add(w.id, w.item.num_tokens)
            self.queued[w.id] = w
        self._update_queue_gauges()
        self.dispatch()

    def cancel(self, works: list[WorkItem]) -> None:
        """Forget every item of a request that has not completed: queued ones never reach a group."""
        for w in works:
            if self.scheduler.cancel(w.id):
                self.queued.pop(w.id, None)
            if not w.future.done():
                w.future.cancel()  # an in-flight result for it is dropped on arrival
            elif not w.future.cancelled():
                w.future.exception()  # mark a failure nobody awaited as seen (no "never retrieved" noise)
        self._update_queue_gauges()

    def dispatch(self) -> None:
        """Give every idle group the next batch from the head of the queue."""
        for group in self.groups:
            if not group.idle:
                continue
            works = self._next_works()
            if not works:
                return
            self._send_batch(group, works)

    def _next_works(self) -> list[WorkItem]:
        now = time.monotonic()
        while (ids := self.scheduler.next_batch()) is not None:
            works = [self.queued.pop(i) for i in ids]  # type: ignore[call-overload]  # ids are our ints
            live = []
            for w in works:
                if w.deadline <= now:  # past --request_timeout_s while queued: dropped, never encoded
                    _settle(w, exc=Timeout("the image waited in the queue past --request_timeout_s"))
                else:
                    live.append(w)
            if live:
                return live
        return []

    def _send_batch(self, group: WorkerGroup, works: list[WorkItem]) -> None:
        self._batch_ids += 1
        now = time.monotonic()
        tokens = sum(w.item.num_tokens for w in works)
        for w in works:
            w.queue_s = now - w.enqueued_at
            self.metrics.stage_seconds.labels(stage="queue").observe(w.queue_s)
        self.metrics.batch_tokens.observe(tokens)
        self.metrics.batch_images.observe(len(works))
        if self.config.budget_enabled:
            self.metrics.batch_fill_ratio.observe(tokens / self.config.visual_batch_max_tokens)
        self._update_queue_gauges()
        group.inflight = self._batch_ids
        self.inflight[self._batch_ids] = (group, works, now)
        try:
            group.send(m.BatchMsg(batch_id=self._batch_ids, items=[w.item for w in works]))
        except Exception as exc:  # zmq refused the batch: the group cannot take work
            self.fail_group(group, f"could not hand a batch to group {group.index}: {exc}")

    def _update_queue_gauges(self) -> None:
        self.metrics.queue_tokens.set(self.scheduler.queued_tokens)
        self.metrics.queue_images.set(self.scheduler.queued_items)

    # ------------------------------------------------------------------------------------ status socket

    async def read_status(self, sock: zmq.asyncio.Socket) -> None:
        """Every rank's READY / ALIVE / RESULT / ERROR; malformed frames are logged and dropped."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                msg = m.decode([f.buffer for f in frames])
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
            self._on_alive(group, msg)
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

    def _on_alive(self, group: WorkerGroup, msg: m.AliveMsg) -> None:
        if 0 <= msg.rank < len(group.last_seen):
            group.last_seen[msg.rank] = time.monotonic()
        if msg.rank == 0 and msg.heartbeats > group.heartbeats:
            self.metrics.heartbeats_total.inc(msg.heartbeats - group.heartbeats)
            group.heartbeats = msg.heartbeats

    def _on_ready(self, group: WorkerGroup, msg: m.ReadyMsg) -> None:
        group.ready[msg.rank] = msg
        group.last_seen[msg.rank] = time.monotonic()
        global_rank = group.index * self.config.tp + msg.rank
        self.metrics.reserved_memory_bytes.labels(rank=str(global_rank)).set(msg.reserved_bytes)
        if len(group.ready) == self.config.tp and group.state is GroupState.STARTING:
            group.state = GroupState.READY
            log.info("encoder group %d ready (pids %s)", group.index, group.pids)
            self._update_ready_gauge()
            self.dispatch()

    def _on_result(self, group: WorkerGroup, msg: m.ResultMsg) -> None:
        entry = self.inflight.pop(msg.batch_id, None)
        if entry is None or entry[0] is not group:
            log.warning("dropped a result for unknown batch %d from group %d", msg.batch_id, group.index)
            return
        _, works, started = entry
        group.inflight = None
        group.last_seen[0] = time.monotonic()
        seconds = time.monotonic() - started
        self.metrics.stage_seconds.labels(stage="encode").observe(seconds)
        tokens = sum(w.item.num_tokens for w in works)
        if seconds > 0:
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * tokens / seconds if self.tokens_per_s else tokens / seconds
        if len(msg.outputs) != len(works):
            self.fail_group(group, f"group {group.index} returned {len(msg.outputs)} outputs for {len(works)} images")
            return
        for w, out in zip(works, msg.outputs, strict=False):
            w.encode_s = seconds
            if _settle(w, result=out):
                self.metrics.images_total.labels(outcome="encoded").inc()
        self.dispatch()

    # ------------------------------------------------------------------------------------ faults

    def _on_error(self, group: WorkerGroup, msg: m.ErrorMsg) -> None:
        """A rank failed. Its peers usually fail a moment later in the collective ("connection reset");
        wait a beat so the error names the root cause first, then fail the group."""
        where = f"batch {msg.batch_id}" if msg.batch_id >= 0 else msg.stage
        group.errors.append(f"rank {msg.rank} of group {group.index} failed ({where}): {msg.message}")
        if len(group.errors) == 1:
            asyncio.get_running_loop().call_later(ERROR_GRACE_S, self.fail_group, group, None)

    def fail_group(self, group: WorkerGroup, reason: str | None) -> None:
        """Fail the group's in-flight work, tear it down (no orphans), and stop serving if none is left."""
        if group.state in (GroupState.FAILED, GroupState.STOPPED):
            return
        reason = "; ".join([*group.errors, *([reason] if reason else [])])  # reported errors first
        group.mark_failed(reason)
        group.kill()
        error = f"encoder group {group.index} failed: {reason}"
        for batch_id, (g, works, _) in list(self.inflight.items()):
            if g is group:
                del self.inflight[batch_id]
                for w in works:
                    _settle(w, exc=EncoderFailed(error))
        group.inflight = None
        self._update_ready_gauge()
        if not any(g.alive for g in self.groups):
            self._fail_queue(EncoderFailed(f"no encoder group is left; {error}"))
            self.all_failed.set()
        else:
            self.dispatch()  # the surviving groups take the queue

    def _fail_queue(self, exc: Exception) -> None:
        for w in self.queued.values():
            self.scheduler.cancel(w.id)
            _settle(w, exc=exc)
        self.queued.clear()
        self._update_queue_gauges()

    def _update_ready_gauge(self) -> None:
        ready = sum(len(g.ready) for g in self.groups if g.state is GroupState.READY)
        self.metrics.workers_ready.set(ready)


def _settle(w: WorkItem, *, result: EncodedImage | None = None, exc: Exception | None = None) -> bool:
    """Complete a work item's future once; False when it was already done (e.g. cancelled)."""
    if w.future.done():
        return False
    if exc is not None:
        w.future.set_exception(exc)
    else:
        assert result is not None, "a work item is settled with a result or an exception"
        w.future.set_result(result)
    return True
