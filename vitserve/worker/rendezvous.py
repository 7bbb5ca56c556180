"""Where a TP group's ranks meet, through torch.distributed's own stores, and how ranks on other nodes stay seen.

- One node (no master address): a FileStore in the engine's private runtime dir. torch's TCPStore server
  listens on every interface whatever address it is given, and vitserve listens on loopback only.
- A master address (--master_addr, or torchrun's MASTER_ADDR), which --nnodes > 1 needs: a TCPStore at
  master_addr:master_port + group, hosted by rank 0 on node 0. Under torchrun with
  TORCHELASTIC_USE_AGENT_STORE=True its agent already hosts that store, and every rank is a client, as
  torch.distributed's own env:// rendezvous does it. Keys live under `vitserve/g<group>/`.

Liveness across nodes: a rank on another node cannot reach node 0's ipc status socket. It adds 1 to its key
`alive/<rank>` in the group's store every heartbeat_s / 2 (StoreBeat.publish, from its liveness thread), and
rank 0's liveness thread reports an ALIVE to the engine for every remote rank whose count moved
(StoreBeat.moved), so the engine's watchdog judges a remote rank's silence exactly like a local one's.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from vitserve.config import TORCHRUN_MASTER_PORT, Config


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet (resolved by the engine or the node, passed down to every rank)."""

    file: str | None = None  # FileStore path (one node)
    addr: str = "127.0.0.1"  # TCPStore host, when file is None
    port: int = 0
    agent_store: bool = False  # torchrun's agent hosts the TCPStore: every rank connects as a client

    @property
    def where(self) -> str:
        return self.file if self.file is not None else f"{self.addr}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def resolve(config: Config, environ: Mapping[str, str], *, group: int, private_dir: str) -> Rendezvous:
    """Group `group`'s rendezvous: --master_addr or torchrun's MASTER_ADDR, else a FileStore in `private_dir`.
    The port: --master_port or MASTER_PORT, plus the group index; 29500 (torchrun's) across nodes; else free."""
    addr = config.master_addr or environ.get("MASTER_ADDR")
    if not addr:
        return Rendezvous(file=f"{private_dir}/store-{group}")
    base = config.master_port or int(environ.get("MASTER_PORT") or 0)
    if not base and config.nnodes > 1:
        base = TORCHRUN_MASTER_PORT
    port = base + group if base else free_port(addr)
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # the test torch's env:// makes
    return Rendezvous(addr=addr, port=port, agent_store=agent)


def _prefix(group: int) -> str:
    return f"vitserve/g{group}"


def open_store(rv: Rendezvous, *, world_size: int, rank: int, group: int, timeout: timedelta) -> dist.Store:
    """The store the group's process group is built on; rank 0 hosts a TCPStore unless torchrun's agent does."""
    if rv.file is not None:
        file_store = dist.FileStore(rv.file, world_size)
        file_store.set_timeout(timeout)
        return file_store
    host = rank == 0 and not rv.agent_store
    tcp = dist.TCPStore(rv.addr, rv.port, world_size, host, timeout=timeout)
    return dist.PrefixStore(_prefix(group), tcp)


class StoreBeat:
    """One rank's part in the liveness across nodes: publish its own count, or (rank 0) read the others'.

    It opens its own client connection (the liveness thread's, not the process group's) whose operations
    give up after `timeout_s`: a node 0 that is gone or cut off raises instead of hanging the thread."""

    def __init__(self, rv: Rendezvous, *, group: int, rank: int, watch: range, timeout_s: float):
        tcp = dist.TCPStore(
            rv.addr, rv.port, None, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self._store = dist.PrefixStore(_prefix(group), tcp)
        self.rank = rank
        self._seen = dict.fromkeys(watch, 0)  # rank -> its count when last read

    def publish(self) -> None:
        self._store.add(f"alive/{self.rank}", 1)

    def moved(self) -> list[int]:
        """The watched ranks whose count moved since the last call (add 0 reads, and creates a missing key)."""
        moved = []
        for rank, last in self._seen.items():
            count = self._store.add(f"alive/{rank}", 0)
            if count != last:
                self._seen[rank] = count
                moved.append(rank)
        return moved


def beat_for(
    rv: Rendezvous, *, tp: int, nnodes: int, group: int, rank: int, heartbeat_s: float
) -> StoreBeat | None:
    """The StoreBeat a rank needs: rank 0 watches the ranks off node 0, which publish; None on one node and
    for node 0's other ranks (they reach the engine's status socket themselves)."""
    per_node = tp // nnodes
    if nnodes <= 1 or rv.file is not None or 0 < rank < per_node:
        return None
    watch = range(per_node, tp) if rank == 0 else range(0)
    return StoreBeat(rv, group=group, rank=rank, watch=watch, timeout_s=max(1.0, heartbeat_s))
