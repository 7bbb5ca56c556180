"""vitserve/worker/rendezvous.py: where a group's ranks meet, and the liveness relayed through the store."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from vitserve.config import Config
from vitserve.worker.rendezvous import Rendezvous, StoreBeat, beat_for, free_port, resolve

pytestmark = pytest.mark.unit


def test_one_node_meets_in_a_private_file_and_nodes_at_the_master():
    assert resolve(Config(), {}, group=1, private_dir="/d") == Rendezvous(file="/d/store-1")
    nodes = Config(tp=2, nnodes=2, master_addr="10.0.0.1")
    assert resolve(nodes, {}, group=0, private_dir="/d") == Rendezvous(addr="10.0.0.1", port=29500)
    env = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert resolve(Config(), env, group=2, private_dir="/d") == Rendezvous(
        addr="10.0.0.2", port=1236, agent_store=True
    )


def test_rank_0_hears_a_remote_rank_only_while_its_count_moves():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    rv = Rendezvous(addr="127.0.0.1", port=port)
    args = {"tp": 4, "nnodes": 2, "group": 0, "heartbeat_s": 1.0}
    watcher, remote = beat_for(rv, rank=0, **args), beat_for(rv, rank=3, **args)
    assert watcher is not None
    assert remote is not None
    assert beat_for(rv, rank=1, **args) is None  # node 0's other ranks reach the engine themselves
    assert beat_for(Rendezvous(file="/f"), rank=0, **args) is None
    assert watcher.moved() == []
    remote.publish()
    assert watcher.moved() == [3]
    assert watcher.moved() == []  # silent since: not heard again
    del server


def test_a_remote_rank_whose_store_is_gone_gets_an_error_not_a_hang():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    beat = StoreBeat(Rendezvous(addr="127.0.0.1", port=port), group=0, rank=1, watch=range(0), timeout_s=1.0)
    beat.publish()
    del server  # node 0's rank 0 exits: its store goes with it
    with pytest.raises(RuntimeError):
        beat.publish()
