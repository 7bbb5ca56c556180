"""The fetcher's counters (vitserve/connector/fetch.py) as the connector reports them to vLLM's /metrics
(pulling.py `Puller.counters`, counters.py): fetches started, kept (with their bytes), failed by reason, in
flight, over real ZMQ between a real producer and the fetcher. The same names in a real vLLM's /metrics:
tests/vllm/test_pull.py."""

from __future__ import annotations

import logging

import pytest

from tests.ports import unused_port
from tests.unit.test_pull_fetch import EXPECT, Kept, ended, fetcher, message, running
from vitserve.connector import counters
from vitserve.connector.config import ConnectorConfig
from vitserve.connector.pulling import Puller

pytestmark = pytest.mark.unit


def test_every_fetch_started_ends_counted_once_kept_with_its_bytes_or_failed_by_reason():
    sent = message("a" * 64)
    nbytes = sum(t.numel() * t.element_size() for t in (sent.embedding, *sent.deepstack))
    nobody = f"tcp://127.0.0.1:{unused_port()}"
    with running({sent.uuid: sent}) as producer, fetcher(Kept(), pull_from=("127.0.0.1",)) as f:
        f.start("a" * 64, producer.endpoint, EXPECT)
        f.start("b" * 64, producer.endpoint, EXPECT)  # not held there
        f.start("c" * 64, nobody, EXPECT)  # nothing listens
        f.start("d" * 64, "tcp://10.9.9.9:5700", EXPECT)  # not admitted: refused at once
        outcomes = [ended(f, u * 64) for u in "abcd"]
        got = f.counters()
    assert [o.kept for o in outcomes] == [True, False, False, False]
    assert got == {
        "started": 4,
        "kept": 1,
        "bytes": nbytes,
        "ms": round(outcomes[0].seconds * 1000),  # the kept one's alone
        "missing": 1,
        "unreachable": 1,
        "refused": 1,
        "timeout": 0,
        "error": 0,
        "late": 0,
        "unreadable": 0,
        "in_flight": 0,
    }


class _Store:
    """What the puller needs of the store: keep a fetched message; no incoming area (the bytes come)."""

    def accept(self, message) -> str | None:
        return None

    def area(self) -> None:
        return None


def test_the_pullers_counters_become_the_connectors_metrics():
    sent = message("e" * 64)
    puller = Puller(ConnectorConfig(None, wait_s=10), None, _Store(), logging.getLogger("test"))  # type: ignore[arg-type]
    try:
        with running({sent.uuid: sent}) as producer:
            puller.fetcher.start("e" * 64, producer.endpoint, EXPECT)
            puller.fetcher.start("f" * 64, producer.endpoint, EXPECT)
            ended(puller.fetcher, "e" * 64)
            ended(puller.fetcher, "f" * 64)
        now = puller.counters()
    finally:
        puller.close()
    assert now["pull_started"] == 2
    assert now["pull_kept"] == 1
    assert now["pull_bytes"] > 0
    assert now["pull_ms"] >= 0
    assert now["pull_failed_missing"] == 1
    assert now["pull_in_flight"] == 0
    data = counters.delta({}, counters.snapshot({}, now))
    assert data["counts"] == {
        "pull_started": 2,
        "pull_kept": 1,
        "pull_bytes": now["pull_bytes"],
        "pull_failed_missing": 1,
        **({"pull_ms": now["pull_ms"]} if now["pull_ms"] else {}),  # a loopback fetch may take under 0.5 ms
    }
    assert data["gauges"] == {"pull_in_flight": 0}
    names = {counters.metric(name) for name in data["counts"]}
    assert names - {("pull_ms", None)} == {
        ("pull_started", None),
        ("pull_kept", None),
        ("pull_bytes", None),
        ("pull_failed", "missing"),
    }
    assert {"pull_started", "pull_kept", "pull_bytes", "pull_ms", "pull_late"} <= set(counters.COUNTERS)
    assert "pull_in_flight" in counters.GAUGES
