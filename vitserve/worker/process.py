"""A rank as an OS process: the entry point multiprocessing runs (spawned, or forked from the ranks'
forkserver, processes/zygote.py), which sets what belongs to the whole process before the rank starts: signals,
the CPU allocator, its share of the cores, the parent it dies with. The rank itself is worker/rank.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import torch

from vitserve.worker.args import WorkerArgs, on_cuda
from vitserve.worker.liveness import die_with_parent
from vitserve.worker.rank import RankWorker


def run_worker(args: WorkerArgs) -> None:
    """Process entry point (top level so the spawn context can import it)."""
    logging.basicConfig(
        level=args.config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [g{args.group}r{args.rank}] %(name)s: %(message)s",
    )
    # Ctrl-C signals the whole process group; the engine drains and then sends STOP, so ranks ignore it.
    # SIGTERM keeps its default: multiprocessing's exit handler terminates daemon children with it and
    # then joins them without a timeout.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not args.config.device.startswith("cuda"):
        # Before any thread of ours exists (zmq I/O, liveness), so that they share the main thread's heap.
        from vitserve.model.fast_alloc import tune_cpu_allocator

        tune_cpu_allocator()
    if not on_cuda(args.config):  # the node's ranks share its cores: split them instead of oversubscribing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (len(args.config.node_ranks) * args.config.dp)))
    assert args.parent_pid is not None  # a process always has the service (or its forkserver) to watch
    parent = watched_parent(args.parent_pid)
    die_with_parent(parent)
    args = dataclasses.replace(args, parent_pid=parent)
    worker = RankWorker(args)
    worker.exit(worker.serve())


def watched_parent(service_pid: int) -> int:
    """The process whose exit ends this rank: the service that spawned it, or the forkserver it was forked
    from (vitserve/processes/zygote.py), which itself dies with the service. Exits now if the service is gone."""
    parent = os.getppid()
    if parent != service_pid:
        try:
            os.kill(service_pid, 0)
        except ProcessLookupError:
            os._exit(1)
    return parent
