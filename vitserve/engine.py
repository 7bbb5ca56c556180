"""The engine: what the HTTP front end calls. Owns the queue, the futures, deadlines and the LLM push.

    engine = Engine(config, metrics)            # encoder_factory=None -> load_configured_encoder
    await engine.start()                         # spawn dp x tp ranks, wait for every READY
    results = await engine.encode(request_id, items, image_ids, deadline=..., return_embeddings=False)
    await engine.shutdown()                      # drain, STOP, join, clean files

`engine.failed` (asyncio.Event) is set when no encoder group is left (every rank of every group died or
hung): from then on encode() raises EncoderFailed, and the CLI should exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from vitserve.cache import make_cache
from vitserve.config import Config
from vitserve.engine_dedup import Slot, WorkTable
from vitserve.engine_dispatch import Dispatcher
from vitserve.engine_send import LLMPush
from vitserve.errors import ConfigError, EncoderFailed, NotReady, QueueFull, Timeout
from vitserve.metrics import Metrics
from vitserve.model.base import Encoder
from vitserve.parallel import messages as m
from vitserve.parallel.pool import GroupState, WorkerGroup, free_port
from vitserve.parallel.watchdog import Watchdog
from vitserve.parallel.worker import Rendezvous, load_configured_encoder, startup_timeout_s
from vitserve.types import EncodedImage, ImageResult, ProcessedImage

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: Config, metrics: Metrics, *, encoder_factory: Callable[[Config], Encoder] | None = None,
                 environ: Mapping[str, str] | None = None, processor_clamp: Mapping[str, Any] | None = None):
        self.config = config
        self.metrics = metrics
        self.encoder_factory = encoder_factory or load_configured_encoder
        self.processor_clamp = processor_clamp  # the processor's clamp_info(); part of the cache fingerprint
        self._init_rendezvous(os.environ if environ is None else environ)
        self._init_state()

    def _init_rendezvous(self, environ: Mapping[str, str]) -> None:
        """Where each group's torch.distributed store listens: the config, else torchrun's env, else a
        free port on 127.0.0.1 per group (read here, at construction, and passed down)."""
        self._master_addr = self.config.master_addr or environ.get("MASTER_ADDR")  # None: one host, FileStore
        port = self.config.master_port or environ.get("MASTER_PORT")
        self._master_port = int(port) if port else None

    def _init_state(self) -> None:
        self._dispatch = Dispatcher(self.config, self.metrics)
        self.failed = self._dispatch.all_failed  # set when no encoder group is left
        self._table = WorkTable(self._dispatch, make_cache(self.config, self.metrics))  # cache + dedup
        self._started = False
        self._draining = False
        self._active = 0  # encode() calls in progress
        self._tasks: list[asyncio.Task[None]] = []
        self._ipc_dir: str | None = None
        self._closed = False  # torn down (after shutdown() or a failed start())
        self._push: LLMPush | None = None  # once started with --llm_endpoint

    # ------------------------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        """Spawn dp x tp ranks and return once every rank reported READY (after its reservation)."""
        self._init_llm_push()  # first: a bad --llm_endpoint fails before any rank is spawned
        self._ipc_dir = tempfile.mkdtemp(prefix="vitserve-")  # 0700: only this user reaches the sockets
        self._zmq = zmq.asyncio.Context()
        self._sync_zmq = zmq.Context()
        self._status = self._zmq.socket(zmq.PULL)
        self._status.setsockopt(zmq.LINGER, 0)
        status_endpoint = f"ipc://{self._ipc_dir}/status"
        self._status.bind(status_endpoint)
        for g in range(self.config.dp):
            group = WorkerGroup(g, self.config, self.encoder_factory, ctx=self._sync_zmq, ipc_dir=self._ipc_dir,
                                status_endpoint=status_endpoint, rendezvous=self._rendezvous(g))
            self._dispatch.groups.append(group)
        self._watchdog = Watchdog(self._dispatch.groups, self.config.heartbeat_s, self._dispatch.fail_group)
        self._tasks = [asyncio.create_task(self._dispatch.read_status(self._status), name="vitserve-status"),
                       asyncio.create_task(self._watchdog.run(), name="vitserve-watchdog")]
        for group in self._dispatch.groups:
            group.spawn()
        try:
            await self._wait_ready()
        except BaseException:
            await self._teardown()
            raise
        if self._push is not None:
            self._push.model = self.info()["model"]  # known once the ranks loaded it
        self._table.set_fingerprint(self.config, self.processor_clamp, self.info(),
                                    self._dispatch.groups[0].ready[0].device)
        self._started = True

    def _rendezvous(self, group: int) -> Rendezvous:
        if self._master_addr is None:
            return Rendezvous(file=f"{self._ipc_dir}/store-{group}")
        port = self._master_port + group if self._master_port else free_port(self._master_addr)
        return Rendezvous(addr=self._master_addr, port=port)

    async def _wait_ready(self) -> None:
        limit = startup_timeout_s(self.config)
        end = time.monotonic() + limit
        groups = self._dispatch.groups
        while not all(g.state is GroupState.READY for g in groups):
            failed = [g for g in groups if g.state is GroupState.FAILED]
            if failed:
                raise ConfigError(f"encoder start-up failed: {failed[0].failure}{_startup_hint(failed[0].failure)}")
            if time.monotonic() > end:
                raise ConfigError(f"encoder ranks did not finish start-up within {limit:g}s "
                                  "(--dist_timeout_s, at least 120 s)")
            await asyncio.sleep(0.05)

    def _init_llm_push(self) -> None:
        if self.config.llm_endpoint:
            self._push = LLMPush(self.config.llm_endpoint, self.metrics)

    async def shutdown(self) -> None:
        """Refuse new work, let accepted requests finish (each bounded by its deadline), stop the ranks.
        Safe to call twice, after a failed start(), or without start()."""
        self._draining = True
        if self._ipc_dir is None or self._closed:
            return
        cap = time.monotonic() + self.config.request_timeout_s + 5
        while self._active and time.monotonic() < cap:
            await asyncio.sleep(0.05)
        stopping = [g for g in self._dispatch.groups if g.state is GroupState.READY]
        for group in stopping:
            group.send(m.StopMsg())
            group.state = GroupState.STOPPED  # the watchdog leaves it alone while it exits
        for group in stopping:
            if not await asyncio.to_thread(group.join, max(5.0, 2 * self.config.heartbeat_s)):
                log.warning("group %d did not stop cleanly; killing it", group.index)
        await self._teardown()

    async def _teardown(self) -> None:
        """Kill whatever still runs (no orphans), stop the tasks, remove sockets and reservation files."""
        if self._closed:
            return
        self._closed = True
        for group in self._dispatch.groups:
            group.kill()
            self._remove_reservations(group)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._push is not None:
            await asyncio.to_thread(self._push.close)
        self._status.close(linger=0)
        self._zmq.term()
        self._sync_zmq.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self.metrics.workers_ready.set(0)

    def _remove_reservations(self, group: WorkerGroup) -> None:
        """Ranks remove their own file on a clean exit; this covers ranks that were killed."""
        from vitserve.reservation import remove_reservation

        for rank, ready in group.ready.items():
            device = ready.device.split(":")[0]
            remove_reservation(self.config.runtime_dir, device, group.index * self.config.tp + rank)

    # ------------------------------------------------------------------------------------ state

    def readiness(self) -> tuple[bool, str]:
        if self._draining:
            return False, "shutting down"
        if not self._started:
            return False, "encoder ranks are starting (loading weights, reserving memory)"
        failed = [g.failure for g in self._dispatch.groups if g.state is GroupState.FAILED]
        if failed:
            return False, "; ".join(f for f in failed if f)
        now, limit = time.monotonic(), 2 * self.config.heartbeat_s
        if self._watchdog.loop_stalled(now):  # our loop was blocked: reports may be unread, not missing
            return True, "ok"
        for group in self._dispatch.groups:
            for rank, seen in enumerate(group.last_seen):
                if now - seen > limit:
                    return False, f"rank {rank} of group {group.index} has not reported for {now - seen:.1f}s"
        return True, "ok"

    def info(self) -> dict[str, Any]:
        readies = [(g.index * self.config.tp + r, msg) for g in self._dispatch.groups for r, msg in g.ready.items()]
        first = readies[0][1] if readies else None
        return {
            "model": first.model_name if first else None,
            "family": first.family if first else None,
            "embed_dim": first.embed_dim if first else None,
            "dtype": first.dtype if first else None,
            "tp": self.config.tp,
            "dp": self.config.dp,
            "reserved_memory_bytes": {rank: msg.reserved_bytes for rank, msg in sorted(readies)},
            "reserved_source": first.reserved_source if first else None,
        }

    @property
    def queue_tokens(self) -> int:
        return self._dispatch.scheduler.queued_tokens

    @property
    def queue_images(self) -> int:
        return self._dispatch.scheduler.queued_items

    @property
    def llm_messages_sent(self) -> int:
        """Embedding messages handed to --llm_endpoint so far (0 without one)."""
        return self._push.sent if self._push is not None else 0

    def groups(self) -> list[dict[str, Any]]:
        """Per encoder group: {"group", "state" (starting|ready|failed|stopped), "failure", "pids"}."""
        return [{"group": g.index, "state": g.state.value, "failure": g.failure, "pids": g.pids}
                for g in self._dispatch.groups]

    def worker_pids(self) -> dict[int, list[int]]:
        """Group index -> pids of its ranks (for the CLI's logs and for fault tests)."""
        return {g.index: g.pids for g in self._dispatch.groups}

    # ------------------------------------------------------------------------------------ encode

    async def encode(self, request_id: str, items: list[ProcessedImage], image_ids: list[str], *,
                     deadline: float, return_embeddings: bool) -> list[ImageResult]:
        """Encode a request's images, push each to the LLM in order, return once all were handed over.
        Cache hits and images already queued or encoding (same sha256 image_id) are not encoded again."""
        self._admit([])
        slots = self._table.acquire(items, image_ids, deadline)  # see engine_dedup.py
        self._active += 1
        try:
            fresh = self._table.fresh_works(slots)
            self._admit([w.item for w in fresh])  # only new work counts against --max_queue_tokens
            self._dispatch.add(fresh)
            return await self._complete(request_id, slots, image_ids, deadline, return_embeddings)
        finally:
            self._table.release(slots)  # timeout, disconnect or error: drop queued work nobody else awaits
            self._active -= 1

    def _admit(self, items: list[ProcessedImage]) -> None:
        if self._draining:
            raise NotReady("the server is shutting down and accepts no new requests")
        if self.failed.is_set():
            reasons = "; ".join(g.failure or "" for g in self._dispatch.groups)
            raise EncoderFailed(f"no encoder group is left to serve: {reasons}")
        if not self._started:
            raise NotReady("encoder ranks are still starting")
        limit = self.config.queue_token_limit
        queued, tokens = self.queue_tokens, sum(it.num_tokens for it in items)
        # An empty queue always admits, so one request larger than the limit is not refused forever.
        if limit is not None and queued and tokens and queued + tokens > limit:
            raise QueueFull(f"{queued} tokens are queued and this request adds {tokens}, above --max_queue_tokens "
                            f"{limit}", retry_after_s=self._retry_after_s(queued))

    def _retry_after_s(self, queued: int) -> float:
        rate = self._dispatch.tokens_per_s
        return float(min(60, max(1, math.ceil(queued / rate)))) if rate > 0 else 1.0

    async def _complete(self, request_id: str, slots: list[Slot], image_ids: list[str], deadline: float,
                        return_embeddings: bool) -> list[ImageResult]:
        results = []
        for k, slot in enumerate(slots):
            # shielded: this request leaving must not cancel an encode that other requests share
            encoded = slot.cached
            if encoded is None:
                encoded = await _wait(asyncio.shield(slot.future), deadline, request_id)
            send_s = 0.0
            if self._push is not None:  # image k goes out only after 0..k-1 were handed over
                send_s = await self._push.push(request_id=request_id, image_index=k, num_images=len(slots),
                                               image_id=image_ids[k], item=slot.item, encoded=encoded,
                                               deadline=deadline)
            if slot.reused:  # a cache hit, or another request's encode of the same image
                self.metrics.images_total.labels(outcome="cached").inc()
            queue_s, encode_s = slot.timing
            results.append(ImageResult(
                num_tokens=slot.item.num_tokens, embedding=encoded.embedding if return_embeddings else None,
                deepstack=list(encoded.deepstack) if return_embeddings else [], cached=slot.reused,
                timing_ms={"queue": queue_s * 1e3, "encode": encode_s * 1e3, "send": send_s * 1e3}))
        return results


def _startup_hint(failure: str | None) -> str:
    if failure and "out of memory" in failure.lower():
        return ("; the worst-case reservation did not fit: lower --visual_batch_max_tokens, raise --tp, "
                "or set --visual_reserved_mem_gb")
    return ""


async def _wait(future: asyncio.Future[EncodedImage], deadline: float, request_id: str) -> EncodedImage:
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        return await asyncio.wait_for(future, remaining)
    except (TimeoutError, asyncio.TimeoutError):
        raise Timeout(f"request {request_id} did not finish within its deadline (--request_timeout_s)") from None
