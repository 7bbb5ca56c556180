"""Holds queries (docs/wire.md): the sender asks the receiver which of some uuids it still keeps, over the same
DEALER connection as the embeddings, and the receiver answers `{"held": [...], "query_id": ...}` (the codec is
rpc/replies.py). What it says it holds it keeps at least until the query's `expires_at`. Their counterpart, a
release (`{"release": [...], "request_id": ...}`, no answer), lets go of what a failed request pushed.

vitserve's vLLM connector (--llm_transport wire) keeps an embedding until the request that names it has loaded it
or its deadline passed; a repeated image is pushed again only when the connector no longer holds it. These
queries live in the sender's I/O thread (`Queries`); callers wait on `PendingHolds.held`.
"""

from __future__ import annotations

import contextlib
import queue
import time
import uuid
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from vitserve.rpc.replies import encode_holds

if TYPE_CHECKING:
    from vitserve.rpc.wirekey import Tagged


@dataclass(eq=False)
class PendingHolds:
    """Which of `uuids` the receiver keeps. `held` resolves to that subset, or raises (no answer by the
    deadline, sender closed)."""

    uuids: list[str]
    deadline: float  # time.monotonic() based
    keep_until: float  # Unix time: what is held is kept at least until then (the request's expiry)
    query_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    held: Future[set[str]] = field(default_factory=Future)
    sent: bool = False  # on the current connection


class Queries:
    """The queries of one sender; every method but `put` runs on its I/O thread."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[PendingHolds] = queue.SimpleQueue()
        self._open: dict[str, PendingHolds] = {}  # by query_id

    def put(self, query: PendingHolds) -> None:
        self._inbox.put(query)

    def take(self) -> None:
        while True:
            try:
                query = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._open[query.query_id] = query

    @property
    def unsent(self) -> bool:
        return any(not q.sent for q in self._open.values())

    def send(self, sock: zmq.Socket[bytes] | Tagged) -> None:
        """Send each query not sent on this connection yet, while the socket takes them."""
        for q in self._open.values():
            if q.sent:
                continue
            try:
                sock.send(encode_holds(q.uuids, q.query_id, q.keep_until), flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            q.sent = True

    def answer(self, query_id: str, held: tuple[str, ...]) -> None:
        query = self._open.pop(query_id, None)
        if query is not None:
            _resolve(query.held, set(held) & set(query.uuids))

    def expire(self, now: float, late: Exception) -> float | None:
        """Fail the queries past their deadline; returns the next deadline (None: no query open)."""
        for q in [q for q in self._open.values() if q.deadline <= now]:
            del self._open[q.query_id]
            _resolve(q.held, exc=late)
        return min((q.deadline for q in self._open.values()), default=None)

    def disconnected(self) -> None:
        """Asked again on the next connection while their deadline lasts."""
        for q in self._open.values():
            q.sent = False

    def fail_all(self, exc: Exception) -> None:
        self.take()
        for q in self._open.values():
            _resolve(q.held, exc=exc)
        self._open.clear()


class Releases:
    """Releases waiting for the sender's I/O thread and a connection: `put` from any thread, the rest on the
    I/O thread. A release not sent within KEEP_S is dropped (what it names then goes at the connector's
    expiry), and at most MAX wait (the oldest go first)."""

    KEEP_S = 10.0
    MAX = 256

    def __init__(self) -> None:
        self._waiting: deque[tuple[bytes, float]] = deque(maxlen=self.MAX)  # (frame, monotonic deadline)

    def put(self, frame: bytes) -> None:
        self._waiting.append((frame, time.monotonic() + self.KEEP_S))  # deque.append is thread-safe

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def send(self, sock: zmq.Socket[bytes] | Tagged) -> None:
        """Send the waiting releases in order while the socket takes them; drop those past their time."""
        now = time.monotonic()
        while self._waiting:
            frame, deadline = self._waiting[0]
            if deadline > now:
                try:
                    sock.send(frame, flags=zmq.NOBLOCK)
                except zmq.Again:
                    return
            self._waiting.popleft()


def _resolve(future: Future[set[str]], result: set[str] | None = None, exc: Exception | None = None) -> None:
    with contextlib.suppress(InvalidStateError):
        if exc is None:
            future.set_result(result or set())
        else:
            future.set_exception(exc)
