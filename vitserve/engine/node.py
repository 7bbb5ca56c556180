"""A node that runs encoder ranks only (--node_rank > 0): no HTTP, no queue, no LLM handoff.

    code = run_node(config, checkpoint, os.environ, stress_shape)  # the process exit code (docs/api.md)

It spawns this node's --tp / --nnodes ranks of the one TP group (a WorkerGroup, as node 0's engine does),
which meet node 0's ranks at the group's TCPStore (worker/rendezvous.py) and then run whatever rank 0
broadcasts. Their READY and ERROR reports come to a private ipc status socket here; their liveness goes to
node 0 through the store. `run_node` returns when:
- node 0 stopped the group (its drain broadcast STOP, and every rank here exited 0): 0;
- a rank here exited otherwise (node 0 went away: gloo saw its sockets close, or the store stopped
  answering; or the rank failed): 1, with the rank's reason on stderr;
- SIGTERM / SIGINT: the ranks get SIGTERM, then SIGKILL after 1 s; 0 once the ranks had joined node 0's
  group, 128 + N before (as the serving node's exit codes).
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping

import zmq

from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.engine.groups import TERM_GRACE_S, WorkerGroup
from vitserve.worker import messages as m
from vitserve.worker import rendezvous
from vitserve.worker.args import load_configured_encoder
from vitserve.worker.reservation import StressShape
from vitserve.worker.reservation.published import remove_killed

log = logging.getLogger(__name__)
POLL_MS = 250  # how often the ranks' processes are checked while no report comes
EXIT_WAIT_S = 5.0  # once one rank exited, how long the others get to follow


def _say(config: Config, line: str) -> None:
    """A line on stderr whatever --log_level says, like node 0's banner."""
    print(f"vitserve node {config.node_rank} of {config.nnodes}: {line}", file=sys.stderr, flush=True)


class _Signals:
    """SIGTERM / SIGINT recorded instead of ending the process, so that the ranks are reaped first."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received = signum


def run_node(
    config: Config, checkpoint: Checkpoint, environ: Mapping[str, str], stress_shape: StressShape
) -> int:
    """stress_shape: the worst case node 0's ranks reserve for, built the same way (vitserve/cli.py): a TP
    group's ranks run the stress's forwards together."""
    signals = _Signals()
    ipc_dir = tempfile.mkdtemp(prefix="vitserve-node-")  # 0700: only this user reaches the socket
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    status = ctx.socket(zmq.PULL)
    status.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/status"
    status.bind(endpoint)
    rv = rendezvous.resolve(config, environ, group=0, private_dir=ipc_dir)
    group = WorkerGroup(
        0,
        config,
        functools.partial(load_configured_encoder, checkpoint),
        ctx=ctx,
        ipc_dir=ipc_dir,
        status_endpoint=endpoint,
        rendezvous=rv,
        stress_shape=stress_shape,
    )
    ranks = config.node_ranks
    _say(
        config, f"ranks {ranks.start}..{ranks.stop - 1} of --tp {config.tp}; waiting for node 0 at {rv.where}"
    )
    try:
        group.spawn()
        return _watch(config, group, status, signals, rv.where)
    finally:
        group.kill(grace_s=TERM_GRACE_S)
        remove_killed(config.runtime_dir, map(group.global_rank, config.node_ranks), group.pids)
        status.close(linger=0)
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _watch(
    config: Config, group: WorkerGroup, status: zmq.Socket[bytes], signals: _Signals, node0: str
) -> int:
    joined = False
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            _say(config, f"stopped by {name}; the ranks here are gone, node 0's group fails with them")
            return 0 if joined else 128 + signals.received
        if status.poll(POLL_MS):
            joined = _on_report(config, group, status.recv_multipart(), node0) or joined
        exited = group.health(time.monotonic(), silence=False)
        if exited is not None:
            return _after_exit(config, group, exited, node0)


def _on_report(config: Config, group: WorkerGroup, frames: list[bytes], node0: str) -> bool:
    """Handle one rank report; True when it was the READY that completed this node."""
    try:
        msg = m.decode(frames)
    except m.MessageError as exc:
        log.warning("dropped a malformed message on the status socket: %s", exc)
        return False
    if isinstance(msg, m.ReadyMsg) and group.on_ready(msg):
        _say(config, f"every rank here is up and in node 0's group at {node0}; node 0 serves")
        return True
    if isinstance(msg, m.ErrorMsg):
        group.errors.append(f"rank {msg.rank} ({msg.stage}): {msg.message}")
    return False


def _after_exit(config: Config, group: WorkerGroup, exited: str, node0: str) -> int:
    """A rank exited: wait for the others, then 0 when node 0 stopped the group cleanly, else 1."""
    if group.join(EXIT_WAIT_S):
        _say(config, "node 0 stopped the group; exiting")
        return 0
    why = "; ".join(group.errors) or exited
    _say(config, f"node 0 at {node0} went away or a rank here failed ({why}); exiting")
    return 1
