"""Encoder groups as seen from the engine: spawn, talk to rank 0, tear down without orphans.

A group is `tp` spawned processes sharing one torch.distributed process group; rank 0 PULLs batches from
the group's own ZMQ socket (rank 0 binds it in the engine's private runtime dir; the engine connects).
Every rank PUSHes to the engine's one status socket. At most one batch is in flight per group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from enum import Enum
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp
import zmq

from vitserve.config import Config
from vitserve.model.base import Encoder
from vitserve.parallel import messages as m
from vitserve.parallel.worker import Rendezvous, WorkerArgs, run_worker

log = logging.getLogger(__name__)
SEND_WAIT_MS = 2000  # the most the event loop waits for rank 0's batch socket to accept a message


class GroupState(Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class WorkerGroup:
    def __init__(self, index: int, config: Config, encoder_factory: Callable[[Config], Encoder], *,
                 ctx: zmq.Context[zmq.Socket[bytes]],
                 ipc_dir: str, status_endpoint: str, rendezvous: Rendezvous):
        self.index = index
        self.config = config
        self.state = GroupState.STARTING
        self.failure: str | None = None  # why the group failed, for readiness() and errors
        self.errors: list[str] = []  # ERROR reports from its ranks, in arrival order
        self.ready: dict[int, m.ReadyMsg] = {}  # rank -> its READY
        self.last_seen: list[float] = [time.monotonic()] * config.tp  # rank -> last ALIVE/READY/RESULT
        self.inflight: int | None = None  # batch id, None when idle
        self.heartbeats = 0  # rank 0's cumulative heartbeat count, as last reported
        self._factory = encoder_factory
        self._status_endpoint = status_endpoint
        self._rendezvous = rendezvous
        self.batch_endpoint = f"ipc://{ipc_dir}/batch-{index}"
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Rank 0 binds, we connect: a connecting PUSH has its queue from the start, so a batch sent right
        # after READY waits there even if rank 0's end is not wired yet (a bound PUSH without a peer
        # refuses a non-blocking send: EAGAIN).
        self._sock.setsockopt(zmq.RECONNECT_IVL, 20)  # rank 0 binds seconds later; retry often (ms)
        self._sock.connect(self.batch_endpoint)
        self.processes: list[BaseProcess] = []

    # ------------------------------------------------------------------------------------ life cycle

    def spawn(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.config.tp):
            args = WorkerArgs(config=self.config, encoder_factory=self._factory, group=self.index, rank=rank,
                              rendezvous=self._rendezvous,
                              batch_endpoint=self.batch_endpoint, status_endpoint=self._status_endpoint,
                              parent_pid=os.getpid())
            proc = ctx.Process(target=run_worker, args=(args,), name=f"vitserve-g{self.index}r{rank}", daemon=True)
            proc.start()
            self.processes.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]  # None only before start()

    @property
    def alive(self) -> bool:
        return self.state in (GroupState.STARTING, GroupState.READY)

    @property
    def idle(self) -> bool:
        return self.state is GroupState.READY and self.inflight is None

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

    def mark_failed(self, reason: str) -> None:
        """Remember why; the caller fails the group's work. Idempotent."""
        if self.state is GroupState.FAILED:
            return
        log.error("encoder group %d failed: %s", self.index, reason)
        self.state, self.failure = GroupState.FAILED, reason

    def kill(self) -> None:
        """SIGKILL every rank (also a SIGSTOPped one) and reap them: no orphans, no zombies."""
        for proc in self.processes:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.processes:
            proc.join(timeout=5)
        self._sock.close(linger=0)

    def join(self, timeout_s: float) -> bool:
        """Wait for a clean exit after STOP; True when every rank exited with code 0."""
        end = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        return all(p.exitcode == 0 for p in self.processes)

    # ------------------------------------------------------------------------------------ watchdog

    def fault(self, now: float, *, silence: bool = True) -> str | None:
        """Why this group cannot serve, or None: a rank exited, or (silence=True) a ready rank went silent."""
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                return f"rank {rank} (pid {proc.pid}) of group {self.index} exited with code {proc.exitcode}"
        if self.state is not GroupState.READY or not silence:
            return None  # start-up has its own time limit; ranks are silent while importing torch
        limit = 2 * self.config.heartbeat_s
        for rank, seen in enumerate(self.last_seen):
            if now - seen > limit:
                return (f"rank {rank} (pid {self.processes[rank].pid}) of group {self.index} missed heartbeats "
                        f"for {now - seen:.1f}s (> 2 x --heartbeat_s = {limit:g}s); it is hung or stopped")
        return None
