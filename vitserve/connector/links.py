"""The fetcher's sockets (vitserve/connector/fetch.py): one DEALER per producer, a CURVE client with the wire's
key, and a monitor on each that says when a producer will not answer: it refused the handshake (another key, or
not vitserve), refuses connections (nothing listens: a killed replica), or dropped the connection after taking a
query (a query written to a dropped connection is never answered). Used by the fetcher's thread only.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from vitserve.rpc.wirekey import configure_client

IDLE_LINK_S = 60.0  # a producer's socket unused this long is closed (a replica scaled away)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# what a DEALER's monitor tells of a producer that will not answer: its queries fail now, not at their deadline
_GONE = _HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


def _why_gone(producer: str, event: int) -> str:
    if event & _HANDSHAKE_FAILED:
        name = zmq.Event(event).name
        return f"{producer} refused the handshake ({name}): another key_file, or not vitserve"
    if event == zmq.EVENT_DISCONNECTED:  # a query written to a connection that dropped is never answered
        return f"the connection to {producer} dropped before its answer came (the replica stopped, or sent more than a pull may bring)"
    return f"{producer} refuses connections (is the replica running, and is it reached there?)"


@dataclass
class Link:
    producer: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    used: float  # monotonic: the last query sent


class Links:
    """One DEALER per producer, opened on its first query, each with its monitor (see the module docstring)."""

    def __init__(self, key: bytes | None, max_frame_bytes: int) -> None:
        self.key = key
        # ZMQ_MAXMSGSIZE: a frame past all that a pull may bring drops the connection before it is allocated
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context(io_threads=1)
        self.links: dict[str, Link] = {}

    def send(self, producer: str, frame: bytes) -> None:
        link = self.links.get(producer) or self._open(producer)
        link.used = time.monotonic()
        with contextlib.suppress(zmq.Again):  # HWM reached: the fetch ends at its deadline
            link.sock.send(frame, zmq.NOBLOCK)

    def _open(self, producer: str) -> Link:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if self.key is not None:
            configure_client(sock, self.key)
        monitor = sock.get_monitor_socket(_GONE)
        sock.connect(producer)
        self.links[producer] = Link(producer, sock, monitor, time.monotonic())
        return self.links[producer]

    def poll(self, wake: socket.socket, timeout_ms: int) -> dict[object, int]:
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        for link in self.links.values():
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        return dict(poller.poll(timeout_ms))

    def readable(self, events: dict[object, int]) -> list[Link]:
        return [link for link in self.links.values() if link.sock in events]

    def refused(self, events: dict[object, int]) -> list[tuple[str, str]]:
        """(producer, why) for each producer whose monitor says it will not answer."""
        return [
            (link.producer, _why_gone(link.producer, recv_monitor_message(link.monitor)["event"]))
            for link in self.links.values()
            if link.monitor in events
        ]

    def drop(self, producer: str) -> None:
        link = self.links.pop(producer, None)
        if link is not None:
            link.monitor.close(linger=0)
            link.sock.close(linger=0)

    def drop_unused(self, timed_out: set[str], busy: set[str], now: float) -> None:
        """Close the links of producers that let a query time out, and of those idle for long."""
        idle = {p for p, link in self.links.items() if p not in busy and now - link.used > IDLE_LINK_S}
        for producer in timed_out | idle:
            self.drop(producer)

    def close(self) -> None:
        for producer in list(self.links):
            self.drop(producer)
        self.ctx.term()
