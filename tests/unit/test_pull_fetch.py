"""A pull without vLLM (vitserve/connector/fetch.py, vitserve/connector/producer.py, vitserve/rpc/pull.py): real ZMQ
on loopback between the consumer's fetcher and a real producer (or a bare ROUTER that answers when the test says);
what is kept, what fails and why, who may be pulled from, and the bounds on fetches in flight."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import zmq

from tests.connector_messages import message
from tests.ports import unused_port
from vitserve.connector.fetch import Allowlist, Expect, FetchConfig, Fetcher, Outcome
from vitserve.connector.producer import Producer
from vitserve.rpc.pull import Missing, decode_answer, decode_fetch, encode_fetch, encode_missing
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_embedding_message

pytestmark = pytest.mark.unit
SECRET = b"s" * 32
OTHER = b"o" * 32
QUIET_MS = 300  # no query beyond the bounds follows within this (the fetcher sends at once when it may)
ENDS_S = 30.0  # a fetch that must end does so within its deadline; this only stops a broken test


EXPECT = Expect(rows=12, width=24, dtype="float32")


class Kept:
    """The store's side of a fetch: keeps what it is handed, or refuses with `refuse`."""

    def __init__(self, refuse: str | None = None) -> None:
        self.messages: dict[str, ImageEmbedding] = {}
        self.refuse = refuse

    def __call__(self, m: ImageEmbedding) -> str | None:
        if self.refuse is None:
            assert m.uuid is not None
            self.messages[m.uuid] = m
        return self.refuse


@contextlib.contextmanager
def running(held: dict[str, ImageEmbedding], key: bytes | None = None):
    producer = Producer("tcp://127.0.0.1:*", held.get, key=key)
    try:
        yield producer
    finally:
        producer.close()


@contextlib.contextmanager
def fetcher(kept: Kept, **config):
    f = Fetcher(FetchConfig(**config), kept)
    try:
        yield f
    finally:
        f.close()


def ended(f: Fetcher, uuid: str) -> Outcome:
    end = time.monotonic() + ENDS_S
    while (outcome := f.result(uuid)) is None:
        assert time.monotonic() < end, f"the fetch of {uuid} never ended: {f.counters()}"
        time.sleep(0.005)
    return outcome


def test_a_fetched_message_is_handed_to_the_store_whole():
    sent = message("a" * 64)
    kept = Kept()
    with running({sent.uuid: sent}, key=SECRET) as producer, fetcher(kept, key=SECRET) as f:
        assert f.start("a" * 64, producer.endpoint, EXPECT) is None
        outcome = ended(f, "a" * 64)
    assert outcome.kept, outcome.reason
    got = kept.messages["a" * 64]
    assert torch.equal(got.embedding, sent.embedding)
    assert all(torch.equal(a, b) for a, b in zip(got.deepstack, sent.deepstack, strict=True))
    assert got.expires_at == sent.expires_at, "the consumer keeps it no longer than the producer would"
    assert producer.counts["served"] == 1
    assert f.counters()["kept"] == 1


def test_one_fetch_per_uuid_at_a_time_and_poll_reports_each_end_once():
    sent = message("b" * 64)
    with running({sent.uuid: sent}) as producer, fetcher(Kept()) as f:
        assert f.start("b" * 64, producer.endpoint) is None
        assert f.start("b" * 64, producer.endpoint) is None  # under way: nothing new is sent
        ended(f, "b" * 64)
        assert [o.uuid for o in f.poll()] == ["b" * 64]
        assert f.poll() == []
    assert producer.counts["served"] == 1


def test_the_fetchers_thread_sleeps_while_a_fetch_waits():
    """A waiting fetch costs the thread about one turn per poll period (100 ms), never a busy loop (a wake-up
    left unread made every poll return at once: ~50,000 turns a second)."""
    producer = BareProducer()
    with contextlib.closing(producer.sock), fetcher(Kept(), deadline_s=ENDS_S) as f:
        f.start("8" * 64, producer.endpoint)
        producer.take(1)
        before = f.loops
        time.sleep(1.0)
        assert f.loops - before <= 30


def test_an_item_the_producer_does_not_hold_fails_with_its_reason():
    with running({}) as producer, fetcher(Kept()) as f:
        f.start("c" * 64, producer.endpoint)
        outcome = ended(f, "c" * 64)
    assert not outcome.kept
    assert "does not hold it" in outcome.reason
    assert "not held here" in outcome.reason
    assert f.counters()["missing"] == 1


def test_a_producer_that_is_not_there_fails_the_fetch_before_its_deadline():
    nobody = f"tcp://127.0.0.1:{unused_port()}"
    with fetcher(Kept(), deadline_s=ENDS_S) as f:
        f.start("d" * 64, nobody)
        outcome = ended(f, "d" * 64)
    assert not outcome.kept
    assert "refuses connections" in outcome.reason
    assert outcome.seconds < ENDS_S, "told by the refused connection, not by the deadline"


def test_an_empty_scheduler_step_waits_for_a_running_fetch_until_it_ends():
    """wait_while_running (the glue calls it on a step with nothing to run): at once when no fetch runs; while
    one runs, until it ends, not its timeout."""
    with running({"e" * 64: message("e" * 64)}) as producer, fetcher(Kept()) as f:
        start = time.monotonic()
        f.wait_while_running(ENDS_S)
        assert time.monotonic() - start < ENDS_S, "no fetch runs: no wait"
        f.start("e" * 64, producer.endpoint, EXPECT)
        f.wait_while_running(ENDS_S)
        waited = time.monotonic() - start
        outcome = f.result("e" * 64)
    assert outcome is not None, "the wait ended with the fetch"
    assert outcome.kept
    assert waited < ENDS_S, "woken by the fetch's end, not at the wait's timeout"


def test_an_idle_scheduler_waits_for_its_requests_fetches_alone_until_they_end_or_its_bound():
    """wait_for (the glue's wait in place when the engine has nothing else to run): False at once when none of
    the uuids is being fetched; while one is, until it ends (another fetch still running does not hold it), or
    until its bound."""
    producer = BareProducer()
    with contextlib.closing(producer.sock), fetcher(Kept(), deadline_s=ENDS_S) as f:
        assert f.wait_for(["1" * 64], ENDS_S) is False, "no fetch of it runs: no wait"
        f.start("1" * 64, producer.endpoint, EXPECT)
        f.start("2" * 64, producer.endpoint, EXPECT)
        producer.take(2)
        start = time.monotonic()
        assert f.wait_for(["1" * 64], 0.3) is True
        assert time.monotonic() - start >= 0.3, "unanswered: it waits out its bound"
        assert f.busy("1" * 64)
        first = producer.queries.index(next(q for q in producer.queries if q[1] == "1" * 64))
        producer.answer(first, message("1" * 64))
        start = time.monotonic()
        assert f.wait_for(["1" * 64], ENDS_S) is True
        waited = time.monotonic() - start
        outcome = f.result("1" * 64)
        assert outcome is not None
        assert outcome.kept
        assert f.busy("2" * 64), "the other request's fetch still runs: not waited for"
    assert waited < ENDS_S, "woken by its fetch's end, not at the bound"


def test_a_producer_that_stops_fails_the_fetches_it_took():
    """A replica killed after it took a query: the connection drops, and the fetch fails then."""
    producer = BareProducer()
    with fetcher(Kept(), deadline_s=ENDS_S) as f:
        f.start("d" * 64, producer.endpoint)
        producer.take(1)
        producer.sock.close(linger=0)
        outcome = ended(f, "d" * 64)
    assert "dropped before its answer came" in outcome.reason
    assert outcome.seconds < ENDS_S


def test_a_producer_that_never_answers_fails_the_fetch_at_its_deadline():
    producer = BareProducer()  # takes the query, says nothing: a stalled replica
    with contextlib.closing(producer.sock), fetcher(Kept(), deadline_s=0.3) as f:
        f.start("d" * 64, producer.endpoint)
        outcome = ended(f, "d" * 64)
    assert "no answer in 0.3 s" in outcome.reason
    assert outcome.seconds >= 0.3


@pytest.mark.parametrize(
    ("producer", "why"),
    [
        ("tcp://10.1.2.3:5700", "host 10.1.2.3 is not admitted by pull_from"),
        ("tcp://vitserve-0.example:5700", "host vitserve-0.example is not admitted"),
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("udp://127.0.0.1:5700", "tcp://HOST:PORT"),
        ("tcp://[::ffff:10.0.0.1]:5700", "not admitted"),
        ("tcp://0.0.0.0:5700", "a bind address"),
    ],
)
def test_a_producer_outside_pull_from_is_refused_at_once(producer, why):
    with fetcher(Kept()) as f:
        outcome = f.start("e" * 64, producer)
        assert outcome is not None
        assert not outcome.kept
        assert why in outcome.reason
        assert f.result("e" * 64) == outcome
        assert f.counters()["refused"] == 1


def test_pull_from_admits_hosts_and_networks_and_refuses_what_is_neither():
    allow = Allowlist(["10.0.0.0/8", "vitserve-0.vitserve", "fd00::/8"])
    assert allow.refuses("tcp://10.2.3.4:5700") is None
    assert allow.refuses("tcp://VITSERVE-0.vitserve:5700") is None
    assert allow.refuses("tcp://[fd00::1]:5700") is None
    assert allow.refuses("tcp://127.0.0.1:5700") is not None, "loopback is the default, not always admitted"
    assert allow.refuses("ipc:///tmp/x") is not None
    assert Allowlist(["127.0.0.1"]).refuses("ipc:///tmp/x") is None
    for bad in ("", "*", "0.0.0.0", "10.0.0.0/99"):
        with pytest.raises(ValueError, match="neither a host nor a CIDR"):
            Allowlist([bad])


def test_without_a_key_only_this_hosts_producers_may_be_pulled_from():
    with fetcher(Kept(), pull_from=("10.0.0.0/8",)) as f:
        outcome = f.start("f" * 64, "tcp://10.0.0.5:5700")
    assert outcome is not None
    assert "no key_file" in outcome.reason


@pytest.mark.parametrize(("theirs", "ours"), [(SECRET, OTHER), (SECRET, None)], ids=["other-key", "no-key"])
def test_a_producer_with_another_key_fails_the_fetch_at_the_handshake(theirs, ours):
    sent = message("9" * 64)
    kept = Kept()
    with running({sent.uuid: sent}, key=theirs) as producer, fetcher(kept, key=ours, deadline_s=20) as f:
        f.start("9" * 64, producer.endpoint)
        outcome = ended(f, "9" * 64)
    assert not outcome.kept
    assert "refused the handshake" in outcome.reason, outcome.reason
    assert outcome.seconds < 20, "told by the handshake, not by the deadline"
    assert kept.messages == {}
    assert producer.counts["served"] == 0


def test_the_stores_refusal_and_a_disagreeing_tensor_fail_the_fetch():
    sent = message("1" * 64)
    with running({sent.uuid: sent}) as producer:
        with fetcher(Kept(refuse="the bound is full")) as f:
            f.start("1" * 64, producer.endpoint, EXPECT)
            assert "refused: the bound is full" in ended(f, "1" * 64).reason
        kept = Kept()
        with fetcher(kept) as f:
            f.start("1" * 64, producer.endpoint, Expect(rows=13, width=24, dtype="float32"))
            reason = ended(f, "1" * 64).reason
        assert "12 x 24 float32, the request announced 13 x 24 float32" in reason
        assert kept.messages == {}


def test_a_store_that_raises_fails_that_fetch_and_the_fetcher_goes_on():
    held = {u: message(u) for u in ("5" * 64, "6" * 64)}

    def broken(m: ImageEmbedding) -> str | None:
        if m.uuid == "5" * 64:
            raise OSError("no space left on device")
        return None

    with running(held) as producer, contextlib.closing(Fetcher(FetchConfig(), broken)) as f:
        f.start("5" * 64, producer.endpoint)
        assert "keeping it failed: OSError: no space left on device" in ended(f, "5" * 64).reason
        f.start("6" * 64, producer.endpoint)
        assert ended(f, "6" * 64).kept


def test_an_answer_larger_than_the_bound_is_cut_before_it_is_read():
    """A keyed producer that sends more than the fetcher's byte bound in one frame: ZMQ drops the connection
    (ZMQ_MAXMSGSIZE) before allocating it; the fetch fails, nothing is kept."""
    big = message("4" * 64, rows=400)  # 400 x 8 float32 = 12,800 bytes in its first tensor frame
    kept = Kept()
    with running({big.uuid: big}) as producer, fetcher(kept, max_bytes_in_flight=10_000) as f:
        f.start("4" * 64, producer.endpoint)  # no announcement: counted at the whole bound
        outcome = ended(f, "4" * 64)
    assert "dropped before its answer came" in outcome.reason
    assert kept.messages == {}


def test_a_fetch_larger_than_the_byte_bound_is_refused_at_once():
    with fetcher(Kept(), max_bytes_in_flight=EXPECT.nbytes - 1) as f:
        outcome = f.start("2" * 64, "tcp://127.0.0.1:5700", EXPECT)
    assert outcome is not None
    assert f"{EXPECT.nbytes} bytes are more than a pull may bring" in outcome.reason


class BareProducer:
    """A ROUTER that only records fetch queries; the test answers them."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.queries: list[tuple[bytes, str, str]] = []  # (peer, uuid, query_id)

    def take(self, count: int) -> list[str]:
        """The uuids of the next `count` queries; AssertionError if one more follows at once."""
        for _ in range(count):
            assert self.sock.poll(int(ENDS_S * 1000)), f"{count} queries were to come"
            self._record()
        assert not self.sock.poll(QUIET_MS), "a query beyond the bounds was sent"
        return [q[1] for q in self.queries[-count:]]

    def _record(self) -> None:
        peer, frame = self.sock.recv_multipart()
        query = decode_fetch([frame])
        self.queries.append((peer, query.uuid, query.query_id))

    def answer(self, index: int, held: ImageEmbedding | None) -> None:
        peer, uuid, query_id = self.queries[index]
        if held is None:
            self.sock.send_multipart([peer, encode_missing(uuid, query_id, "gone")])
        else:
            held.message_id = query_id
            self.sock.send_multipart([peer, *encode_embedding_message(held)])


@pytest.mark.parametrize(
    "bounds",
    [{"max_in_flight": 2}, {"max_bytes_in_flight": 2 * EXPECT.nbytes}],
    ids=["count", "bytes"],
)
def test_fetches_beyond_the_bounds_wait_their_turn(bounds):
    producer = BareProducer()
    uuids = [c * 64 for c in "3456"]
    with contextlib.closing(producer.sock), fetcher(Kept(), deadline_s=ENDS_S, **bounds) as f:
        for uuid in uuids:
            assert f.start(uuid, producer.endpoint, EXPECT) is None
        assert producer.take(2) == uuids[:2], "two queries in flight, not four, in start order"
        producer.answer(0, message(uuids[0]))
        assert ended(f, uuids[0]).kept
        assert producer.take(1) == uuids[2:3]
        producer.answer(1, None)
        assert "gone" in ended(f, uuids[1]).reason
        assert producer.take(1) == uuids[3:]
        assert f.counters()["in_flight"] == 2


def test_a_late_answer_is_dropped_and_a_new_fetch_gets_a_new_query():
    producer = BareProducer()
    with contextlib.closing(producer.sock), fetcher(Kept(), deadline_s=0.3) as f:
        f.start("7" * 64, producer.endpoint)
        producer.take(1)
        assert "no answer in 0.3 s" in ended(f, "7" * 64).reason
        f.start("7" * 64, producer.endpoint, deadline_s=ENDS_S)  # asked again: a fresh query, a fresh socket
        producer.take(1)
        producer.answer(0, message("7" * 64))  # the first query's answer: too late
        assert producer.queries[-1][2] != producer.queries[0][2]
        producer.answer(len(producer.queries) - 1, message("7" * 64))
        assert ended(f, "7" * 64).kept
    # the late answer went to the closed socket's peer (dropped by the ROUTER) or was counted as late
    assert f.counters()["kept"] == 1


def test_the_pull_messages_refuse_what_is_not_the_wire():
    assert decode_fetch([encode_fetch("a" * 64, "q1")]).uuid == "a" * 64
    for bad in ("", 7, "x" * 10_000):  # any string of 1-MAX_ID_CHARS is a cache key (rpc/wire.py)
        with pytest.raises(WireError):
            encode_fetch(bad, "q1")  # type: ignore[arg-type]
    with pytest.raises(WireError, match="one frame"):
        decode_fetch([b"x", b"y"])
    with pytest.raises(WireError):
        decode_fetch([b"\xc1"])
    answer = decode_answer([encode_missing("a" * 64, "q1", "gone")])
    assert answer == Missing("q1", "a" * 64, "gone")
    with pytest.raises(WireError, match="`missing`"):
        decode_answer([encode_fetch("a" * 64, "q1")])
