"""The flags of scale-out: tensor-parallel ranks, data-parallel groups, the nodes one group spans and how
their ranks meet (torchrun's environment fills the node flags no flag set: preflight.torchrun_values)."""

from __future__ import annotations

from vitserve.config import Config
from vitserve.flags.spec import Flag, check_positive, optional, parse_int

PARALLELISM: dict[str, Flag] = {
    "tp": Flag(parse_int, "parallelism", "tensor-parallel ranks per encoder group"),
    "dp": Flag(parse_int, "parallelism", "independent encoder groups sharing one queue"),
    "nnodes": Flag(parse_int, "parallelism", "nodes one TP group spans; each runs --tp / --nnodes ranks"),
    "node_rank": Flag(parse_int, "parallelism", "this node's index; 0 serves HTTP, others run ranks only"),
    "master_addr": Flag(
        optional(str), "parallelism", "node 0's address, where the ranks meet (TCPStore)", "none (one node)"
    ),
    "master_port": Flag(
        optional(parse_int), "parallelism", "node 0's TCPStore port (+ group index)", "29500 across nodes"
    ),
    "heartbeat_s": Flag(float, "parallelism", "rank-0 heartbeat interval"),
    "dist_timeout_s": Flag(float, "parallelism", "torch.distributed timeout"),
}


def validate(config: Config) -> None:
    check_positive(config, "tp", "dp", "nnodes", "heartbeat_s", "dist_timeout_s")
    check_positive(config, "node_rank", allow_zero=True)
