"""Encoder groups as seen from the engine: their state machine, their one batch in flight, their health.

A group is `tp` spawned processes sharing one torch.distributed process group; rank 0 PULLs batches from
the group's own ZMQ socket (rank 0 binds it in the engine's private runtime dir; the engine connects).
Every rank PUSHes to the engine's one status socket. At most one batch is in flight per group.
Across nodes (--nnodes > 1) this process spawns only its node's ranks (Config.node_ranks); rank 0 reports
the liveness of the other nodes' ranks (worker/rendezvous.py), so `last_seen` still covers all `tp`.

Only WorkerGroup's own methods change its `state`:

    STARTING --READY of every rank, warm_up()--> WARMING --warmed()--> READY --stop()--> STOPPED
        \\_____________________________fail()__________________________/--> FAILED

WARMING: the group's ranks are up and one small real image is being encoded through the production path
(engine/dispatch.py); only its result makes the group READY, so /ready never reports ranks that cannot
encode. warm_up(None) goes straight to READY (an engine built without a warm-up image).

`health(now)` is the one judgement of whether a group can serve: the Watchdog below fails the groups it
condemns, and Engine.readiness() (so /ready) reports the same verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from multiprocessing.process import BaseProcess

import zmq

from vitserve import processes
from vitserve.config import Config
from vitserve.contract import ProcessedImage
from vitserve.engine.jobs import Job
from vitserve.model.base import Encoder
from vitserve.rpc.tensors import DTYPES
from vitserve.worker import messages as m
from vitserve.worker.args import WorkerArgs
from vitserve.worker.process import run_worker
from vitserve.worker.rendezvous import Rendezvous
from vitserve.worker.reservation import StressShape

log = logging.getLogger(__name__)
SEND_WAIT_MS = 2000  # the most the event loop waits for rank 0's batch socket to accept a message
TERM_GRACE_S = 1.0  # kill(grace_s=...) at teardown: SIGTERM the ranks, SIGKILL those still running after this


class GroupState(Enum):
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(eq=False)
class Batch:
    """Jobs sent to one group together, in flight until its RESULT (or the group's failure)."""

    id: int
    jobs: list[Job]
    started: float  # time.monotonic() at send
    warmup: ProcessedImage | None = None  # the warm-up encode: one image, no Jobs, kept out of the metrics
    slot: str = ""  # the result slot lent for its outputs (worker/slots.py); "" for none

    @property
    def tokens(self) -> int:
        return sum(j.item.num_tokens for j in self.jobs)

    @property
    def items(self) -> list[ProcessedImage]:
        return [self.warmup] if self.warmup is not None else [j.item for j in self.jobs]


class WorkerGroup:
    """`tp` rank processes of one DP group. Subclasses (tests/fakes.py ThreadGroup, the same RankWorker in a
    thread) replace only the process-facing methods: worker_args, spawn, kill, join, pids and _exited."""

    def __init__(
        self,
        index: int,
        config: Config,
        encoder_factory: Callable[[Config], Encoder],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]],
        ipc_dir: str,
        status_endpoint: str,
        rendezvous: Rendezvous,
        stress_shape: StressShape,
    ):
        self.index = index
        self.config = config
        self.state = GroupState.STARTING
        self.failure: str | None = None  # why the group failed, for readiness() and errors
        self.errors: list[str] = []  # ERROR reports from its ranks, in arrival order
        self.setting_error: str | None = None  # a rank's MemoryTargetError: a setting that can never work
        self.ready: dict[int, m.ReadyMsg] = {}  # rank -> its READY
        self.last_seen: list[float] = [time.monotonic()] * config.tp  # rank -> last ALIVE/READY/RESULT
        self.batch: Batch | None = None  # in flight; None when idle
        self.heartbeats = 0  # rank 0's cumulative heartbeat count, as last reported
        self._factory = encoder_factory
        self._status_endpoint = status_endpoint
        self._rendezvous = rendezvous
        self._stress_shape = stress_shape
        self.processes: list[BaseProcess] = []
        self._init_batch_socket(ctx, f"ipc://{ipc_dir}/batch-{index}")

    def _init_batch_socket(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.batch_endpoint = endpoint
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Rank 0 binds, we connect: a connecting PUSH has its queue from the start, so a batch sent right
        # after READY waits there even if rank 0's end is not wired yet (a bound PUSH without a peer
        # refuses a non-blocking send: EAGAIN).
        self._sock.setsockopt(zmq.RECONNECT_IVL, 20)  # rank 0 binds seconds later; retry often (ms)
        self._sock.connect(endpoint)

    def global_rank(self, rank: int) -> int:
        """The rank's number across every group (reservation files, metrics labels)."""
        return self.config.global_rank(self.index, rank)

    # ------------------------------------------------------------------------------------ processes

    def worker_args(self, rank: int) -> WorkerArgs:
        """What rank `rank` of this group is started with."""
        return WorkerArgs(
            config=self.config,
            stress_shape=self._stress_shape,
            encoder_factory=self._factory,
            group=self.index,
            rank=rank,
            rendezvous=self._rendezvous,
            batch_endpoint=self.batch_endpoint,
            status_endpoint=self._status_endpoint,
            parent_pid=os.getpid(),
        )

    def spawn(self) -> None:
        ctx = processes.context()  # the warm forkserver when the CLI started one, else spawn
        for rank in self.config.node_ranks:
            proc = ctx.Process(
                target=run_worker,
                args=(self.worker_args(rank),),
                name=f"vitserve-g{self.index}r{rank}",
                daemon=True,
            )
            proc.start()
            self.processes.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]  # None only before start()

    def send(self, msg: m.BatchMsg | m.StopMsg) -> None:
        """Queue a message for rank 0 (one batch in flight is far below the HWM).

        Normally the socket takes it at once. Under load the ipc connection can still be (re)wiring when a
        batch is due, and the non-blocking send then failed with EAGAIN, failing a healthy group (seen in
        test_f8 on a loaded machine); waiting up to SEND_WAIT_MS for POLLOUT covers that and costs nothing
        when the socket is writable.
        """
        if not self._sock.poll(SEND_WAIT_MS, zmq.POLLOUT):
            raise TimeoutError(f"rank 0 of group {self.index} took no message for {SEND_WAIT_MS} ms")
        self._sock.send_multipart(m.encode(msg), flags=zmq.NOBLOCK, copy=False)

    def kill(self, grace_s: float = 0.0) -> None:
        """End every rank and reap them: no orphans, no zombies. With `grace_s`, SIGTERM first and SIGKILL
        whatever still runs after it; SIGKILL at once otherwise (also ends a SIGSTOPped rank)."""
        if grace_s > 0:
            self._signal_alive(signal.SIGTERM)
            end = time.monotonic() + grace_s
            for proc in self.processes:
                proc.join(timeout=max(0.0, end - time.monotonic()))
        self._signal_alive(signal.SIGKILL)
        for proc in self.processes:
            proc.join(timeout=5)
        self._sock.close(linger=0)

    def _signal_alive(self, sig: signal.Signals) -> None:
        for proc in self.processes:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def join(self, timeout_s: float) -> bool:
        """Wait for a clean exit after STOP; True when every rank exited with code 0."""
        end = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        return all(p.exitcode == 0 for p in self.processes)

    def _exited(self) -> str | None:
        """Which rank's process is gone, if any."""
        for rank, proc in zip(self.config.node_ranks, self.processes, strict=False):
            if not proc.is_alive():
                return f"rank {rank} (pid {proc.pid}) of group {self.index} exited with code {proc.exitcode}"
        return None

    def _where(self, rank: int) -> str:
        """'pid N' for a rank of this node, 'node K' for a rank of another node."""
        local = self.config.node_ranks
        if rank in local and rank - local.start < len(self.pids):
            return f"pid {self.pids[rank - local.start]}"
        return f"node {rank // len(local)}"

    # ------------------------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        return self.state in (GroupState.STARTING, GroupState.WARMING, GroupState.READY)

    @property
    def idle(self) -> bool:
        return self.state is GroupState.READY and self.batch is None

    def heard_from(self, rank: int) -> None:
        if 0 <= rank < len(self.last_seen):
            self.last_seen[rank] = time.monotonic()

    def on_ready(self, msg: m.ReadyMsg) -> bool:
        """Record a rank's READY; True when it was the last rank of a STARTING group (now due to warm_up).
        Across nodes only this node's ranks report READY here; the warm-up encode then needs every node."""
        self.ready[msg.rank] = msg
        self.heard_from(msg.rank)
        return len(self.ready) == len(self.config.node_ranks) and self.state is GroupState.STARTING

    def warm_up(self, batch: Batch | None) -> None:
        """STARTING -> WARMING with the warm-up batch sent to rank 0; with None straight to READY."""
        assert self.state is GroupState.STARTING, f"group {self.index} is {self.state.value}"
        if batch is None:
            self.warmed()
            return
        self.state, self.batch = GroupState.WARMING, batch
        self.send(m.BatchMsg(batch_id=batch.id, items=batch.items, slot=batch.slot))

    def warmed(self) -> None:
        """The group passed its warm-up encode (or has none): it takes work from now on. Every rank took
        part in that encode, so every rank was heard from (the other nodes' ones included)."""
        self.state = GroupState.READY
        self.last_seen = [time.monotonic()] * self.config.tp
        log.info("encoder group %d ready (pids %s)", self.index, self.pids)

    def on_alive(self, msg: m.AliveMsg) -> int:
        """Record a rank's liveness report; returns how many heartbeats rank 0 sent since the last one."""
        self.heard_from(msg.rank)
        if msg.rank != 0 or msg.heartbeats <= self.heartbeats:
            return 0
        new, self.heartbeats = msg.heartbeats - self.heartbeats, msg.heartbeats
        return new

    def start_batch(self, batch: Batch) -> None:
        """Send a batch to rank 0 and hold it as in flight (an idle group only)."""
        assert self.idle, f"group {self.index} is not idle"
        self.batch = batch
        self.send(m.BatchMsg(batch_id=batch.id, items=batch.items, slot=batch.slot))

    def result_sizes(self, batch: Batch) -> list[int]:
        """The bytes of each tensor rank 0 returns for `batch` (an embedding and its DeepStack levels per
        item), from what rank 0 said it is; [] before its READY."""
        ready = self.ready.get(0)
        if ready is None or ready.dtype not in DTYPES:
            return []
        row = ready.embed_dim * DTYPES[ready.dtype].itemsize
        return [it.num_tokens * row for it in batch.items for _ in range(1 + ready.num_deepstack)]

    def finish_batch(self, batch_id: int) -> Batch | None:
        """The in-flight batch a RESULT answers, which is no longer in flight; None when it is not ours."""
        if self.batch is None or self.batch.id != batch_id:
            return None
        batch, self.batch = self.batch, None
        self.heard_from(0)
        return batch

    def fail(self, reason: str) -> Batch | None:
        """READY/STARTING -> FAILED: kill the ranks; returns the batch that was in flight, for its Jobs to
        fail. None (and nothing changes) when the group already failed or stopped."""
        if not self.alive:
            return None
        log.error("encoder group %d failed: %s", self.index, reason)
        self.state, self.failure = GroupState.FAILED, reason
        self.kill()
        batch, self.batch = self.batch, None
        return batch

    def stop(self) -> None:
        """READY -> STOPPED: ask the ranks to exit cleanly; the watchdog leaves the group alone from now."""
        self.send(m.StopMsg())
        self.state = GroupState.STOPPED

    def health(self, now: float, *, silence: bool = True) -> str | None:
        """Why this group cannot serve, or None: a rank exited, or (silence=True) a ready rank said
        nothing for more than 2 x --heartbeat_s."""
        exited = self._exited()
        if exited is not None:
            return exited
        if self.state is not GroupState.READY or not silence:
            return None  # start-up has its own time limit; ranks are silent while importing torch
        limit = 2 * self.config.heartbeat_s
        for rank, seen in enumerate(self.last_seen):
            if now - seen > limit:
                return (
                    f"rank {rank} ({self._where(rank)}) of group {self.index} missed heartbeats "
                    f"for {now - seen:.1f}s (> 2 x --heartbeat_s = {limit:g}s); it is hung or stopped"
                )
        return None


class Watchdog:
    """Finds dead, hung or failed ranks well before --dist_timeout_s.

    Checked every min(heartbeat_s / 4, 0.5) s: `WorkerGroup.health` says why a group cannot serve, and
    `on_fault` fails its work and tears it down. Silence is judged on the engine's event loop, where ALIVE
    reports are read. When that loop itself was blocked, reports may sit unread in the socket; silence
    is then judged one tick later, after the reader caught up (`loop_stalled`), so a busy API process
    does not kill healthy ranks.
    """

    def __init__(
        self, groups: Sequence[WorkerGroup], heartbeat_s: float, on_fault: Callable[[WorkerGroup, str], None]
    ):
        self.groups = groups
        self.period = min(heartbeat_s / 4, 0.5)
        self._stall_limit = self.period + heartbeat_s / 2
        self._on_fault = on_fault
        self.last_tick = time.monotonic()

    def loop_stalled(self, now: float) -> bool:
        """True when the event loop did not run the watchdog for a while (reports may be unread)."""
        return now - self.last_tick > self._stall_limit

    def health(self, group: WorkerGroup, now: float) -> str | None:
        """The group's health as the watchdog judges it now (what /ready reports)."""
        return group.health(now, silence=not self.loop_stalled(now))

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            stalled = self.loop_stalled(now)
            self.last_tick = now
            for group in self.groups:
                if group.alive:
                    self._check(group, now, silence=not stalled)  # exits are judged right away
            await asyncio.sleep(self.period)

    def _check(self, group: WorkerGroup, now: float, *, silence: bool) -> None:
        try:
            reason = group.health(now, silence=silence)
            if reason is not None:
                self._on_fault(group, reason)
        except Exception:  # keep watching the other groups; a dead watchdog would hide every fault
            log.exception("watchdog check of group %d failed", group.index)
