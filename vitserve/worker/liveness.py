"""Worker-side liveness: tell the engine this rank is alive, and die with the parent (docs/design.md invariant 16).

A daemon thread with its own ZMQ socket (sockets are not thread-safe) sends an ALIVE report every
heartbeat_s / 2. It keeps running during a long forward, so a slow batch is not mistaken for a hang; a
SIGSTOPped or dead rank goes silent and the engine's watchdog notices within 2 x heartbeat_s.
The same thread exits the process when the parent is gone (getppid changes), backed by PR_SET_PDEATHSIG.
Across nodes (--nnodes > 1) it also runs the rank's StoreBeat (rendezvous.py): a rank off node 0 publishes
its count in the group's store every report, and rank 0 reads the counts every poll (0.25 s at most) and
reports ALIVE on behalf of every remote rank whose count moved.
A rank off node 0 whose store is gone (node 0 exited or is cut off) exits 1 (unless it is stopping anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import zmq

from vitserve.processes.guard import PR_SET_PDEATHSIG  # does nothing outside the forkserver
from vitserve.worker import messages as m

if TYPE_CHECKING:
    from vitserve.worker.rendezvous import StoreBeat

log = logging.getLogger(__name__)
_PARENT_POLL_S = 0.25
_STOP_GRACE_S = 2.0  # a rank off node 0 that lost the store waits this long for a clean STOP first


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits; exit now if the parent already did."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:  # no libc.so.6 (e.g. musl): the polling thread still covers it
            log.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent poll")
    if os.getppid() != parent_pid:
        os._exit(1)


class LoopCounters:
    """Progress of the rank loop, read by the liveness thread (plain ints: GIL-atomic updates)."""

    def __init__(self) -> None:
        self.heartbeats = 0
        self.batches = 0


class LivenessThread(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        status_endpoint: str,
        *,
        group: int,
        rank: int,
        parent_pid: int | None,  # None: the rank is a thread of the engine's process, no parent to watch
        heartbeat_s: float,
        counters: LoopCounters,
    ):
        super().__init__(name=f"vitserve-liveness-g{group}r{rank}", daemon=True)
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)  # a parent that stops reading must not grow our memory
        self._sock.connect(status_endpoint)
        self._group, self._rank, self._parent_pid = group, rank, parent_pid
        self._interval = max(heartbeat_s / 2, 0.05)
        self._counters = counters
        self._halt = threading.Event()
        self.beat: StoreBeat | None = None  # set once the process group is up, across nodes only
        self.node0 = ""  # node 0's store address, for the log line when it is lost

    def run(self) -> None:
        next_report = 0.0
        while not self._halt.is_set():
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                log.error(
                    "vitserve worker g%d r%d: parent %d is gone; exiting",
                    self._group,
                    self._rank,
                    self._parent_pid,
                )
                os._exit(1)
            now = time.monotonic()
            if now >= next_report:
                self._report()
                next_report = now + self._interval
            if self.beat is not None and self.beat.rank == 0:
                # every poll, not every report: the engine hears a remote rank at most one poll after it
                # published, so a silent one is judged on nearly the same clock as a local one
                self._beat(self.beat)
            self._halt.wait(min(_PARENT_POLL_S, self._interval))
        self._sock.close()

    def _report(self) -> None:
        msg = m.AliveMsg(
            group=self._group,
            rank=self._rank,
            heartbeats=self._counters.heartbeats,
            batches=self._counters.batches,
        )
        with contextlib.suppress(zmq.Again):  # engine busy: the next report will do
            self._sock.send_multipart(m.encode(msg), flags=zmq.NOBLOCK)
        if self.beat is not None and self.beat.rank != 0:
            self._beat(self.beat)

    def _beat(self, beat: StoreBeat) -> None:
        try:
            if beat.rank != 0:
                beat.publish()
                return
            for rank in beat.moved():  # remote ranks that are alive: report them as if they had
                msg = m.AliveMsg(group=self._group, rank=rank, heartbeats=0, batches=0)
                with contextlib.suppress(zmq.Again):
                    self._sock.send_multipart(m.encode(msg), flags=zmq.NOBLOCK)
        except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError: the store is unreachable
            if beat.rank == 0:  # rank 0's own store: the watchdog will see the remote ranks go silent
                log.warning("cannot read the remote ranks' liveness from the store: %s", exc)
                return
            if self._halt.wait(_STOP_GRACE_S):
                return  # node 0 stopped the group cleanly (STOP) and this rank is exiting 0
            log.error("node 0 at %s went away (%s); exiting", self.node0, str(exc).splitlines()[0])
            os._exit(1)

    def stop(self) -> None:
        self._halt.set()
