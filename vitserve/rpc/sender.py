"""LLMSender: vitserve's end of the wire (docs/wire.md), a ZMQ DEALER connected to the receiver's ROUTER.

Delivery is acknowledged: a message is delivered only when the receiver's acknowledgement naming its
message_id comes back, and every message ends in exactly one outcome (`Delivery.acked`): delivered, or
LLMTimeout at its deadline, or NotReady when the sender closes first. Nothing is dropped silently.

One I/O thread owns the socket (ZMQ sockets are not thread-safe): it sends what callers submitted when
the receiver has room, reads acknowledgements, and fails each wait whose deadline passed.

- A message is handed to ZMQ only while a receiver is connected (its ZMTP handshake succeeded, as the
  socket monitor reports). While none is, a message waits in this sender's outbox, never in a ZMQ pipe, so
  a receiver that binds later gets only what is still wanted. This is done here, not with ZMQ_IMMEDIATE:
  with IMMEDIATE, libzmq throws away the pipe when its connection drops, and with it the acknowledgements
  that had arrived and were not read yet (a receiver that acknowledged and then exited at once looked like
  one that never acknowledged: the message failed at its deadline).
- Messages sent but not acknowledged when a connection drops go out again on the next connection while
  their deadline lasts (the receiver drops a copy it already returned: same message_id, acknowledged again),
  so a receiver restarting mid-request does not cost the request. One handed to ZMQ in the moment the
  connection broke, before the monitor said so, may also go out from the pipe: the same dropped copy.
- ZMTP heartbeats notice a receiver that vanished without closing its connection (a dead host).
- A peer that is not an acknowledging ROUTER receiver (a v1 PULL socket) drops the connection during the
  ZMTP handshake (socket types must match), and one keyed with another secret fails it: logged once, the
  reason kept in `link.refusal` (rpc/link.py words it), and the message waits for a real receiver. Reaching
  the receiver and losing it are logged once each.
- vitserve's vLLM connector (--llm_transport wire, docs/vllm.md) may refuse a message (a nack with its
  reason: its bound is full, the tensor is not what it can keep): the delivery fails with WireRefused at once.
  It also answers holds queries (`holds`): which of some uuids it still keeps, over the same connection, and
  takes releases (`release`: let go of what a failed request pushed; no answer).
- With `security="tag"` (--wire_security tag) the socket has no CURVE: every message goes out sealed with a tag
  and every reply is opened (rpc/tag.py); a reply whose tag does not verify is dropped, and `link.refusal` says
  that the two ends hold different secrets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import InvalidStateError

import zmq
from zmq.utils.monitor import recv_monitor_message

from vitserve.errors import ConfigError, LLMTimeout, NotReady, VitserveError
from vitserve.rpc import link, wire
from vitserve.rpc.delivery import Delivery, Unsent, WireRefused, expires_at
from vitserve.rpc.holds import PendingHolds, Queries, Releases
from vitserve.rpc.replies import Held, Nack, decode_reply
from vitserve.rpc.tag import TagError, Tagger
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_embedding_message
from vitserve.rpc.wirekey import Tagged, configure_dealer, read_key_file

log = logging.getLogger(__name__)

# Messages queued in ZMQ before sends wait. Sends are zero-copy, so each queued message keeps its
# embedding alive: 8 x 59 MB (4096 x 3584 float32) = 470 MB at most in the API process.
DEFAULT_SNDHWM = 8
DEFAULT_HEARTBEAT_S = 1.0  # ZMTP ping interval; a receiver silent for 3 intervals is disconnected
_MAX_WAIT_S = 0.1  # longest single poll of the I/O thread


class LLMSender:
    """Sends wire-v3 messages to `endpoint` (tcp://host:port or ipc:///path) and tracks their acks.

    Thread-safe: send/submit may be called from any thread. `delivered`, `timed_out`,
    `late_acks` and `resent` count outcomes; `reachable` says whether a v2 receiver is connected now.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        sndhwm: int = DEFAULT_SNDHWM,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        key_file: str | None = None,
        security: str = "curve",
    ) -> None:
        self.endpoint = endpoint
        self.key_file, self.security = (
            key_file,
            security,
        )  # how the wire is keyed (same_host.py's probe keys so too)
        self.bytes_sent = 0  # header + tensor bytes handed to ZMQ (first sends only)
        self.messages_sent = 0
        self.delivered = 0  # acknowledged in time
        self.timed_out = 0  # not acknowledged by the deadline
        self.late_acks = 0  # acknowledgements that came after their message's deadline
        self.resent = 0  # sent again on a new connection
        self.refused = 0  # messages the receiver refused (nack)
        self.link = link.Link(
            endpoint, keyed=key_file is not None, tagged=security == "tag"
        )  # reachable? why not (`refusal`)?
        self._queries = Queries()  # holds queries (rpc/holds.py)
        self._releases = Releases()  # and releases
        self._closing = False
        self._inbox: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._outbox: deque[Delivery] = deque()  # submitted, not yet taken by ZMQ
        self._unacked: dict[str, Delivery] = {}  # taken by ZMQ, no ack yet
        self._init_socket(sndhwm, heartbeat_s, key_file, security)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="vitserve-llm-io", daemon=True)
        self._thread.start()

    def _init_socket(self, sndhwm: int, heartbeat_s: float, key_file: str | None, security: str) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--llm_endpoint must be tcp://host:port or ipc:///path, got {self.endpoint!r}")
        self._ctx = zmq.Context(io_threads=1)  # private: close() terminates it without touching others
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.LINGER, 0)  # what is unacknowledged at close has failed already
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * heartbeat_s * 1000))
        self._tagger: Tagger | None = None
        if (
            key_file is not None
        ):  # CURVE keys derived from the connector's secret, or a tag per message (wirekey.py)
            try:
                self._tagger = configure_dealer(self._sock, read_key_file(key_file), security)
            except (OSError, ValueError) as exc:
                self._sock.close(linger=0)
                self._ctx.term()
                raise ConfigError(f"--wire_key_file: {exc}") from None
        # what the I/O thread sends through: the socket, or the socket sealing each message with its tag
        self._out: zmq.Socket[bytes] | Tagged = (
            self._sock if self._tagger is None else Tagged(self._sock, self._tagger)
        )
        self._monitor = self._sock.get_monitor_socket(link.EVENTS)
        try:
            self._sock.connect(self.endpoint)  # asynchronous: the receiver may bind later
        except zmq.ZMQError as exc:
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"--llm_endpoint {self.endpoint!r} cannot be connected: {exc}") from exc

    # ------------------------------------------------------------------------------------ callers

    def send(self, message: ImageEmbedding, *, deadline: float) -> Delivery:
        """Queue one message; returns at once. deadline: time.monotonic() value by which the receiver must
        acknowledge it; the message's expires_at is set from it."""
        message.expires_at = expires_at(deadline)
        frames = encode_embedding_message(message)  # gives the message its message_id when it had none
        return self.submit(frames, message_id=message.message_id, deadline=deadline)

    def submit(self, frames: list[bytes | memoryview], *, message_id: str, deadline: float) -> Delivery:
        """Queue pre-encoded frames as one message (see send)."""
        if self._closing:
            raise NotReady(f"the sender to --llm_endpoint {self.endpoint} is closed")
        nbytes = sum(memoryview(f).nbytes for f in frames)
        delivery = Delivery(message_id, frames, deadline, nbytes)
        self._inbox.put(delivery)
        self._wake()
        return delivery

    def holds(self, uuids: list[str], timeout_s: float, *, deadline: float) -> set[str]:
        """Which of `uuids` the receiver keeps now (blocking, at most timeout_s); it keeps those until the
        request's deadline (time.monotonic()) at least. Empty when no receiver is connected, or none answers
        in time: the caller then sends what it needs again."""
        if not uuids or not self.reachable or self._closing:
            return set()
        query = PendingHolds(list(uuids), time.monotonic() + timeout_s, expires_at(deadline))
        self._queries.put(query)
        self._wake()
        try:
            return query.held.result(timeout_s + _MAX_WAIT_S)
        except (VitserveError, TimeoutError):
            return set()

    def release(self, request_id: str, uuids: list[str]) -> None:
        """Tell the connector to let go of `uuids` now (fire and forget, on the I/O thread like holds queries):
        request `request_id` failed before it reached vLLM. Sent once connected, or dropped after a while
        (rpc/holds.py Releases: the connector's expiry remains)."""
        if uuids and not self._closing:
            self._releases.put(encode_release(request_id, uuids))
            self._wake()

    @property
    def reachable(self) -> bool:
        """A v2 receiver completed the handshake and has not disconnected."""
        return self.link.reachable

    @reachable.setter
    def reachable(self, value: bool) -> None:
        self.link.reachable = value

    def wait_reachable(self, timeout_s: float) -> bool:
        """Block until a receiver is connected (True) or timeout_s passed (False)."""
        return self.link.connected.wait(timeout_s)

    def close(self) -> None:
        """Stop the I/O thread; every message not acknowledged yet fails with NotReady."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join()
        self._fail_pending()  # a submit() that raced with closing
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()

    def __enter__(self) -> LLMSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the pipe is full (the thread wakes anyway) or closed
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing:
                self._take_inbox()
                wait_s = self._expire(time.monotonic())
                sending = (
                    self._outbox or self._queries.unsent or self._releases.waiting
                ) and self.reachable  # handshake done: docstring
                poller.register(self._sock, zmq.POLLIN | (zmq.POLLOUT if sending else 0))
                events = dict(poller.poll(max(1, int(wait_s * 1000))))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if self._monitor in events:
                    self._on_monitor()
                if events.get(self._sock, 0) & zmq.POLLIN:
                    self._read_acks()
                if events.get(self._sock, 0) & zmq.POLLOUT:
                    self._releases.send(self._out)  # before a push that may reuse a released uuid
                    self._queries.send(self._out)
                    self._send_queued()
        except Exception:
            log.exception("the sender to --llm_endpoint %s failed; it sends nothing more", self.endpoint)
        finally:
            self._closing = True  # submit() refuses from now on
            self._fail_pending()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)

    def _fail_pending(self) -> None:
        self._take_inbox()
        closed = NotReady("the server shut down before the LLM receiver acknowledged this image")
        for delivery in [*self._outbox, *self._unacked.values()]:
            _settle(delivery, closed)
        self._queries.fail_all(closed)

    def _take_inbox(self) -> None:
        self._queries.take()
        while True:
            try:
                self._outbox.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _expire(self, now: float) -> float:
        """Fail what passed its deadline, forget what callers cancelled; returns how long to poll."""
        wait_s = _MAX_WAIT_S
        for box in (self._outbox, self._unacked.values()):
            for d in list(box):
                if d.acked.cancelled():
                    self._forget(d)
                elif d.deadline <= now:
                    self._forget(d)
                    self.timed_out += 1
                    _settle(d, self._timeout(d))
                else:
                    wait_s = min(wait_s, d.deadline - now)
        next_query = self._queries.expire(now, LLMTimeout(f"no answer to a holds query from {self.endpoint}"))
        return wait_s if next_query is None else min(wait_s, max(next_query - now, 0.0))

    def _forget(self, d: Delivery) -> None:
        if self._unacked.get(d.message_id) is d:
            del self._unacked[d.message_id]
        else:
            self._outbox.remove(d)

    def _timeout(self, d: Delivery) -> LLMTimeout:
        what = f"the LLM receiver at --llm_endpoint {self.endpoint} did not acknowledge an embedding before the request deadline (--request_timeout_s)"
        if d.sent_at is None:
            return Unsent(f"{what}: it could not be sent: no receiver is connected, or it is full")
        why = f": {self.link.refusal}" if self.link.refusal else " (it is slow, hung or gone)"
        return LLMTimeout(f"{what}: it was sent but the receiver did not acknowledge it{why}")

    def _send_queued(self) -> None:
        while self._outbox:
            d = self._outbox[0]
            try:
                # copy=False: ZMQ's I/O thread reads the tensor memory directly. POLLOUT means the
                # whole multipart message fits: the high-water mark is checked at the first frame only.
                self._out.send_multipart(d.frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._outbox.popleft()
            if d.sent_at is None:
                self.messages_sent += 1
                self.bytes_sent += d.nbytes
            d.sent_at = time.monotonic()
            self._unacked[d.message_id] = d

    def _read_acks(self) -> None:
        """Acknowledgements, refusals (nack) and answers to holds queries."""
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(self._opened(frames)[0])
            except TagError as exc:
                self.link.tag_refused(str(exc))
                continue
            except WireError as exc:
                log.error("ignored a reply from the LLM receiver at %s: %s", self.endpoint, exc)
                continue
            if isinstance(reply, Held):
                self._queries.answer(reply.query_id, reply.uuids)
            else:
                self._settle_reply(reply.message_id, reply.reason if isinstance(reply, Nack) else None)

    def _opened(self, frames: list[bytes]) -> list[bytes]:
        """A reply's frames, its tag checked and removed with --wire_security tag (TagError otherwise)."""
        return frames if self._tagger is None else self._tagger.open(frames)

    def _settle_reply(self, message_id: str, nack_reason: str | None) -> None:
        d = self._unacked.pop(message_id, None) or self._queued_again(message_id)
        if d is None:
            self.late_acks += 1  # timed out (or sent twice and acknowledged already)
        # counted before the future completes, so that whoever waited on it reads the count (taken back when the
        # future was done already: cancelled)
        elif nack_reason is not None:
            self.refused += 1
            if not _settle(
                d, WireRefused(f"the receiver at {self.endpoint} refused an embedding: {nack_reason}")
            ):
                self.refused -= 1
        else:
            self.delivered += 1
            if not _settle(d, None):
                self.delivered -= 1

    def _queued_again(self, message_id: str) -> Delivery | None:
        """A sent message that a handshake put back in the outbox (_resend_unacked) before its
        acknowledgement was read: both can come in one poll. Without this, the acknowledgement counted as
        late, the message went out again, and only a receiver that kept reading acknowledged the copy."""
        for d in self._outbox:
            if d.message_id == message_id and d.sent_at is not None:
                self._outbox.remove(d)
                return d
        return None

    def _on_monitor(self) -> None:
        while self._monitor.poll(0):
            message = recv_monitor_message(self._monitor)
            changed = self.link.on_event(message["event"], message["value"])
            if changed is True:
                self._resend_unacked()
            elif changed is False:
                self._queries.disconnected()

    def _resend_unacked(self) -> None:
        """A new connection: what the old one may have lost goes out again, in its original order."""
        if self._unacked:
            self.resent += len(self._unacked)
            self._outbox.extendleft(reversed(self._unacked.values()))
            self._unacked.clear()


def _settle(d: Delivery, exc: Exception | None) -> bool:
    """Complete a delivery's future once; False when it was done already (e.g. cancelled)."""
    try:
        if exc is None:
            d.acked.set_result(None)
        else:
            d.acked.set_exception(exc)
    except InvalidStateError:
        return False
    return True


def encode_release(request_id: str, uuids: list[str]) -> bytes:
    """`{"v": 3, "release": [uuid, ...], "request_id": str}`, one frame, no answer (docs/wire.md). Written here
    with rpc/wire.py's packer until rpc/replies.py has the codec beside the holds query's."""
    return wire._pack({"v": wire.WIRE_VERSION, "release": list(uuids), "request_id": request_id})
