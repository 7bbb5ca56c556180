"""--llm_transport wire in front of a vLLM with data parallelism (--llm_dp_size N; docs/vllm.md, "Push to
data-parallel cores"): vLLM runs N engine cores, each with a connector of its own bound at --llm_endpoint + its
rank (vitserve/endpoints.py `rank_endpoint`: tcp port + rank, ipc path + "-rank"; the connector's `dp_push`).
vitserve keeps one sender per rank, picks the rank of each chat request here, pushes its embeddings to that
rank's connector, and names the rank to vLLM (`X-data-parallel-rank`, which vLLM 0.32's API server reads in
entrypoints/generate/base/serving.py and its balancer obeys), so the core that schedules the request is the one
that holds its embeddings.

The pick: the rank with the fewest requests of this replica in flight (picked, not yet answered), ties in turn
(round robin), among the ranks whose connector is connected (all of them when none is). Another replica's
requests are not seen: with several replicas each balances its own. With one rank (no --llm_dp_size) this is the
one sender, and no header is sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vitserve.handover.same_host import SameHost
from vitserve.rpc.sender import LLMSender

RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the engine core a request goes to


@dataclass
class Rank:
    """One engine core's connector: its sender, its same-host hand-over, this replica's requests there."""

    index: int
    sender: LLMSender
    handoff: SameHost
    in_flight: int = 0

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint


class Ranks:
    """The engine cores' connectors and the pick of a rank per request (safe from any thread)."""

    def __init__(self, senders: list[LLMSender]):
        self.all = [Rank(i, s, SameHost(s)) for i, s in enumerate(senders)]
        self._next = 0  # where the next tie-break starts
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.all)

    def pick(self) -> Rank:
        """The rank for a new request, counted in flight until `done`."""
        with self._lock:
            n = len(self.all)
            turn = [self.all[(self._next + k) % n] for k in range(n)]  # ties go in turn
            connected = [r for r in turn if r.sender.reachable] or turn
            rank = min(connected, key=lambda r: r.in_flight)  # the first of the least busy
            rank.in_flight += 1
            self._next = (rank.index + 1) % n
            return rank

    def done(self, rank: Rank) -> None:
        with self._lock:
            rank.in_flight -= 1

    def headers(self, rank: Rank) -> dict[str, str]:
        """What pins a request to `rank` in vLLM (nothing with one rank)."""
        return {RANK_HEADER: str(rank.index)} if len(self.all) > 1 else {}

    def not_connected(self) -> list[Rank]:
        return [r for r in self.all if not r.sender.reachable]

    def close(self) -> None:
        for rank in self.all:
            rank.sender.close()
