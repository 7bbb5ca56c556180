"""What a rank is handed when it is spawned (`WorkerArgs`), the default encoder it loads
(`load_configured_encoder`, on the device `on_cuda` picks), and how long its start-up may take.

The engine builds one WorkerArgs per rank (engine/groups.py `WorkerGroup.worker_args`); multiprocessing
pickles it into the rank, which runs worker/rank.py `RankWorker` with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.model.base import Encoder
from vitserve.worker.rendezvous import Rendezvous
from vitserve.worker.reservation import StressShape


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a rank needs, handed over once at spawn (multiprocessing pickles it into the child)."""

    config: Config
    stress_shape: StressShape  # the worst case's bounds, built once by the CLI from its image processor
    encoder_factory: Callable[[Config], Encoder]
    group: int  # DP group index
    rank: int  # rank inside the group
    rendezvous: Rendezvous  # where this group's torch.distributed store is
    batch_endpoint: str  # rank 0 only: binds it; the engine's PUSH connects and sends batches
    status_endpoint: str  # every rank: where READY / ALIVE / RESULT / ERROR go
    parent_pid: int | None  # the rank exits when this process is gone; None: a thread of the engine's process

    @property
    def global_rank(self) -> int:
        return self.config.global_rank(self.group, self.rank)

    @property
    def local_index(self) -> int:
        """The rank's number among the ranks of this node (its CUDA device); the global rank on one node."""
        return self.global_rank - self.config.node_ranks.start


def startup_timeout_s(config: Config) -> float:
    """How long start-up (spawn, rendezvous, weights, reservation) may take: --dist_timeout_s, at least 120 s."""
    return max(config.dist_timeout_s, 120.0)


def on_cuda(config: Config) -> bool:
    """Whether --device puts the ranks on CUDA (auto: when it is available)."""
    return config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())


def load_configured_encoder(checkpoint: Checkpoint, config: Config) -> Encoder:
    """The default encoder_factory, bound to the checkpoint the entry point opened (functools.partial):
    it on this rank's device (set by _init_device) in --dtype."""
    from vitserve.model import load_encoder

    device = (
        f"cuda:{torch.cuda.current_device()}" if on_cuda(config) else config.device.replace("auto", "cpu")
    )
    return load_encoder(checkpoint, device=device, dtype=config.dtype)
