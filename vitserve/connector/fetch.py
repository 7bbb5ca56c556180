"""The consumer's end of a pull (SPEC §13; rpc/pull.py has the messages): the connector's scheduler side asks,
and a thread of this module fetches, each announced embedding from the producer (a vitserve replica) that the
chat request names. Nothing here blocks the caller: vLLM's scheduler loop calls `start(uuid, producer)` and later
`result(uuid)` (or `poll()`), and the thread does the network.

Who may be fetched from: an endpoint whose host `pull_from` admits (vitserve/connector/allowlist.py; loopback
only by default). Without a key only this host's endpoints are admitted; with one, every DEALER is a CURVE client
(vitserve/rpc/wirekey.py). A refused endpoint fails the fetch at `start()`, with the reason.

A producer that will not answer fails its fetches as soon as its DEALER's monitor says so, not at their deadline:
it refuses the handshake (another key, or not vitserve), refuses the connection (nothing listens: a killed
replica), or drops it after taking a query (a query written to a dropped connection is never answered). A
producer that takes the query and stays silent (a stalled replica) fails it at the deadline.

Bounds: at most `max_in_flight` queries sent and unanswered, and at most `max_bytes_in_flight` bytes they may
bring (each counted at its announced size); a fetch beyond them waits its turn, within its deadline. A fetch
whose announced size alone passes the byte bound is refused at once (it would wait forever). Every fetch ends by
its deadline (`deadline_s`) after `start()`: kept, refused or failed, each with its reason.

A fetched message is handed to `on_message` (the store's "keep this message") on the fetcher's thread: it
returns None when kept, or why it refused it, which becomes the fetch's reason (an exception in it too: it ends
that fetch, never the fetcher).

Each query names `area`, the store's incoming area, when there is one: a producer on this host answers with a
file it wrote there (a same-host file message, adopted by the store as a push's) instead of the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid as uuids
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

from vitserve.connector.allowlist import DEFAULT_PULL_FROM, Allowlist
from vitserve.connector.links import Link, Links
from vitserve.endpoints import host_only
from vitserve.rpc.handoff import NAME, FileEmbedding
from vitserve.rpc.pull import Area, Missing, decode_answer, encode_fetch
from vitserve.rpc.tensors import DTYPES
from vitserve.rpc.wire import ImageEmbedding, WireError

_POLL_MS = 100  # the longest the thread sleeps with fetches running (a deadline is seen this late at most)
_KEEP_OUTCOME_S = 60.0  # an outcome not taken by then is dropped
# `counters()`: fetches started; how each ended (kept, or failed by reason: ENDINGS); the bytes kept; answers
# dropped (late: to a query given up on; unreadable: not the wire); and, apart, `in_flight` (not ended)
ENDINGS = ("missing", "refused", "unreachable", "timeout", "error")
COUNTS = ("started", "kept", *ENDINGS, "bytes", "ms", "late", "unreadable")


@dataclass(frozen=True)
class FetchConfig:
    """The fetcher's limits (the connector's extra config: pull_from, key_file, wait_s)."""

    pull_from: tuple[str, ...] = DEFAULT_PULL_FROM
    key: bytes | None = None  # the wire's shared secret; None: only this host's producers
    deadline_s: float = 5.0  # from start() to the fetch's end, its wait for a turn included
    max_in_flight: int = 16  # queries sent and not answered
    max_bytes_in_flight: int = 2**30  # their announced bytes together


@dataclass(frozen=True)
class Expect:
    """What the announcement says the tensor is; the answer must agree."""

    rows: int
    width: int  # main rows and every DeepStack level concatenated
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Outcome:
    """How one fetch ended: kept (the store took the message) or not, and why."""

    uuid: str
    producer: str
    kept: bool
    reason: str = ""  # empty when kept
    seconds: float = 0.0  # from start() to the end


@dataclass
class _Fetch:
    uuid: str
    producer: str
    expect: Expect | None
    nbytes: int
    started: float  # monotonic
    deadline_s: float  # from started to its end
    query_id: str = field(default_factory=lambda: uuids.uuid4().hex)
    sent: bool = False


class Fetcher:
    """See the module docstring. `start`, `result`, `poll`, `busy` and `counters` are safe from any thread."""

    def __init__(
        self,
        config: FetchConfig,
        on_message: Callable[[ImageEmbedding | FileEmbedding], str | None],
        *,
        log: logging.Logger | None = None,
        area: Area | None = None,
    ) -> None:
        self.config, self.on_message, self.area = config, on_message, area
        self.allow = Allowlist(config.pull_from)
        self.log = log or logging.getLogger(__name__)
        self.counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Condition(threading.Lock())  # notified when a fetch ends
        self._live: dict[str, _Fetch] = {}  # uuid -> fetch not ended, in start order
        self._ended: dict[str, tuple[Outcome, float]] = {}  # uuid -> (outcome, monotonic end)
        self._fresh: list[Outcome] = []  # ended since the last poll()
        self._closing = False
        self.loops = 0  # the thread's turns: about one per poll period while nothing happens
        self._wake_r, self._wake_w = socket.socketpair()  # start() wakes the thread at once
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="vitserve-ec-fetcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side (any thread)

    def start(
        self, uuid: str, producer: str, expect: Expect | None = None, deadline_s: float | None = None
    ) -> Outcome | None:
        """Fetch `uuid` from `producer` unless a fetch of it is under way. None: under way (see result());
        an Outcome: refused at once (not admitted, too large, closed). `deadline_s` (default: the config's) is
        for a caller whose own wait has less left, e.g. the request's remaining `wait_s`."""
        fetch = _Fetch(
            uuid,
            producer,
            expect,
            expect.nbytes if expect else self.config.max_bytes_in_flight,
            time.monotonic(),
            self.config.deadline_s if deadline_s is None else deadline_s,
        )
        reason = self._refusal(fetch)
        with self._lock:
            if uuid in self._live:
                return None
            self.counts["started"] += 1
            self._ended.pop(uuid, None)
            if reason is not None:
                return self._end(fetch, reason)
            self._live[uuid] = fetch
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"\0")
        return None

    def result(self, uuid: str) -> Outcome | None:
        """How the last fetch of `uuid` ended; None while it runs or when there was none."""
        with self._lock:
            ended = self._ended.get(uuid)
            return ended[0] if ended is not None and uuid not in self._live else None

    def busy(self, uuid: str) -> bool:
        with self._lock:
            return uuid in self._live

    def poll(self) -> list[Outcome]:
        """The fetches that ended since the last poll()."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            return fresh

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "in_flight": len(self._live)}

    def wait_while_running(self, timeout_s: float) -> None:
        """Block up to timeout_s while fetches run and none ends; at once when none runs. For a scheduler step
        with nothing to run: it gives the CPU and the GIL to the fetch rather than step again at once."""
        with self._lock:
            if self._live:
                self._lock.wait(timeout_s)

    def wait_for(self, uuids: Iterable[str], timeout_s: float) -> bool:
        """Block until none of `uuids` is being fetched, or timeout_s; False at once when none was. For a
        scheduler with nothing else to run (glue.py): the request is scheduled in the step that asked."""
        wanted = set(uuids)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if not wanted & self._live.keys():
                return False
            while wanted & self._live.keys() and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
        return True

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(5)
        self._wake_r.close()
        self._wake_w.close()

    def _refusal(self, fetch: _Fetch) -> str | None:
        if self._closing:
            return "the fetcher is closed"
        reason = self.allow.refuses(fetch.producer)
        if reason is None and self.config.key is None and not host_only(fetch.producer):
            reason = f"no key_file: only this host's producers may be pulled from, not {fetch.producer}"
        if reason is None and fetch.nbytes > self.config.max_bytes_in_flight:
            reason = f"{fetch.nbytes} bytes are more than a pull may bring ({self.config.max_bytes_in_flight} bytes)"
        return reason

    def _end(self, fetch: _Fetch, reason: str | None, counter: str = "refused", nbytes: int = 0) -> Outcome:
        """Record how `fetch` ended (under _lock): kept (`nbytes` brought), or `counter` (one of ENDINGS)."""
        outcome = Outcome(
            fetch.uuid, fetch.producer, reason is None, reason or "", time.monotonic() - fetch.started
        )
        self.counts["kept" if reason is None else counter] += 1
        self.counts["bytes"] += nbytes if reason is None else 0
        self.counts["ms"] += round(outcome.seconds * 1000) if reason is None else 0
        if self._live.get(fetch.uuid) is fetch:
            del self._live[fetch.uuid]
        self._ended[fetch.uuid] = (outcome, time.monotonic())
        self._fresh.append(outcome)
        self._lock.notify_all()
        if reason is not None:
            self.log.warning(
                "vitserve connector: pulling %s from %s failed: %s", fetch.uuid, fetch.producer, reason
            )
        return outcome

    # ------------------------------------------------------------------ the fetcher's thread

    def _run(self) -> None:
        links = Links(self.config.key, self.config.max_bytes_in_flight)
        try:
            while not self._closing:
                self.loops += 1
                # 1) sleep until an answer, a handshake failure, a new fetch or the poll period
                events = links.poll(self._wake_r, _POLL_MS)
                # 2) the caller's new fetches are in _live: only the wake-up is read
                self._drain_wakes(events)
                # 3) read what producers answered, and the handshakes they refused
                for link in links.readable(events):
                    self._read(link)
                for producer, why in links.refused(events):
                    self._fail_producer(links, producer, why)
                # 4) send queued queries while the bounds allow, 5) end fetches past their deadline
                self._send_queued(links)
                self._expire(links, time.monotonic())
        except Exception:
            self.log.exception("vitserve connector: the fetcher failed; every fetch of it fails")
            with self._lock:
                for fetch in list(self._live.values()):
                    self._end(fetch, "the fetcher failed (see vLLM's log)", "error")
        finally:
            links.close()

    def _drain_wakes(self, events: dict[object, int]) -> None:
        # zmq.Poller names a plain socket by its fd; undrained, it would wake every poll (a busy loop)
        if self._wake_r.fileno() in events or self._wake_r in events:  # its fetches are in _live already
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)

    def _send_queued(self, links: Links) -> None:
        with self._lock:
            sent = [f for f in self._live.values() if f.sent]
            count, nbytes = len(sent), sum(f.nbytes for f in sent)
            for fetch in [f for f in self._live.values() if not f.sent]:
                if (
                    count >= self.config.max_in_flight
                    or nbytes + fetch.nbytes > self.config.max_bytes_in_flight
                ):
                    break  # in start order: a later small fetch does not overtake an earlier large one
                links.send(fetch.producer, encode_fetch(fetch.uuid, fetch.query_id, self.area))
                fetch.sent, count, nbytes = True, count + 1, nbytes + fetch.nbytes

    def _read(self, link: Link) -> None:
        while True:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._answer(link.producer, frames)

    def _answer(self, producer: str, frames: list[zmq.Frame]) -> None:
        try:
            answer = decode_answer(frames)
        except WireError as exc:
            with self._lock:
                self.counts["unreadable"] += 1
            self.log.warning(
                "vitserve connector: %s answered a pull with something not the wire: %s", producer, exc
            )
            return
        if isinstance(answer, FileEmbedding) and self.area is None:
            with self._lock:
                self.counts["unreadable"] += 1
            self.log.warning(
                "vitserve connector: %s answered a pull with a file, but no area was named", producer
            )
            return
        query_id = answer.query_id if isinstance(answer, Missing) else answer.message_id
        with self._lock:
            fetch = self._live.get(answer.uuid or "")
            if fetch is None or fetch.query_id != query_id or fetch.producer != producer:
                self.counts["late"] += 1  # an answer to a query given up on (or never asked)
                self._discard(answer)
                return
            if isinstance(answer, Missing):
                self._end(fetch, f"{producer} does not hold it: {answer.reason}", "missing")
                return
        reason = _disagrees(answer, fetch.expect) or self._keep(answer)
        if reason is not None:
            self._discard(answer)
        nbytes = _nbytes(answer)
        with self._lock:
            if self._live.get(fetch.uuid) is fetch:
                why = reason and f"{producer} sent it, but it was refused: {reason}"
                self._end(fetch, why, "refused", nbytes)

    def _keep(self, message: ImageEmbedding | FileEmbedding) -> str | None:
        try:
            return self.on_message(message)
        except Exception as exc:  # the store's failure ends this fetch, never the fetcher
            self.log.exception("vitserve connector: keeping a pulled %s failed", message.uuid)
            return f"keeping it failed: {type(exc).__name__}: {exc}"

    def _discard(self, answer: ImageEmbedding | FileEmbedding | Missing) -> None:
        """A file answer not kept: its file goes now (the store's sweep would take it after a minute)."""
        if isinstance(answer, FileEmbedding) and self.area is not None and NAME.fullmatch(answer.name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.area.incoming, answer.name))

    def _fail_producer(self, links: Links, producer: str, why: str) -> None:
        with self._lock:
            for fetch in [f for f in self._live.values() if f.producer == producer]:
                self._end(fetch, why, "unreachable")
        links.drop(producer)

    def _expire(self, links: Links, now: float) -> None:
        with self._lock:
            late = [f for f in self._live.values() if now - f.started >= f.deadline_s]
            for fetch in late:
                waited = "no answer" if fetch.sent else "no turn within the bounds on pulls in flight"
                self._end(fetch, f"{waited} in {fetch.deadline_s:g} s", "timeout")
            for uuid in [u for u, (_, at) in self._ended.items() if now - at > _KEEP_OUTCOME_S]:
                del self._ended[uuid]
            busy = {f.producer for f in self._live.values()}
        # a producer that let a query time out may be gone: its socket goes, with the queries queued in it
        links.drop_unused({f.producer for f in late if f.sent} - busy, busy, now)


def _nbytes(message: ImageEmbedding | FileEmbedding) -> int:
    if isinstance(message, FileEmbedding):
        return message.nbytes
    return sum(t.numel() * t.element_size() for t in (message.embedding, *message.deepstack))


def _disagrees(message: ImageEmbedding | FileEmbedding, expect: Expect | None) -> str | None:
    if expect is None:
        return None
    if isinstance(message, FileEmbedding):
        got = (message.rows, message.width, message.dtype)
    else:
        width = sum(int(t.shape[1]) for t in (message.embedding, *message.deepstack))
        got = (message.num_tokens, width, message.dtype)
    if got != (expect.rows, expect.width, expect.dtype):
        return f"it is {got[0]} x {got[1]} {got[2]}, the request announced {expect.rows} x {expect.width} {expect.dtype}"
    return None
