"""Run a function on N real gloo ranks (127.0.0.1, free port, short timeout), started as the engine starts its
ranks (vitserve/processes/zygote.py): forked from the session's forkserver once tests/conftest.py started it,
spawned otherwise.

    results = run_ranks(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable; one result per rank

`fn` must be a top-level function (spawn pickles it by name). A rank that raises fails the whole call.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import unused_port
from vitserve import processes


def run_ranks(fn, world_size: int, *args, timeout_s: float = 30.0) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        port = unused_port()  # below the ephemeral range: not taken by a connection before the store binds it
        mp.start_processes(
            _rank_main,
            args=(world_size, port, timeout_s, tmp, fn, args),
            nprocs=world_size,
            join=True,
            start_method=processes.context().get_start_method(),
        )
        return [torch.load(Path(tmp) / f"{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, tmp: str, fn, args) -> None:
    torch.set_num_threads(1)  # 2 shared cores: one intra-op thread per rank
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(tmp) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
