"""The connector's ROUTER socket with its limits, so that one peer cannot hold the engine's memory:

- ZMQ_MAXMSGSIZE: the bound plus header room; a larger frame closes that peer's connection before it is allocated;
- ZMQ_RCVHWM: at most RCVHWM whole messages queued per peer, then TCP pushes back on the sender;
- ZMQ heartbeats: a peer silent for HEARTBEAT_TIMEOUT_MS is dropped, with whatever it had half sent.
libzmq bounds each frame, not the number of frames of one unfinished multipart message (its queue counts whole
messages): that is why a keyless connector binds only an endpoint of this host (protected mode, store.py), so
only a holder of the key, or a process of this host, can send at all.

A monitor socket reports failed handshakes (a peer without the key, or not speaking ZMTP): nothing of theirs is
ever read; the store counts them.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import recv_monitor_message

from vitserve.connector import keys
from vitserve.connector.allowlist import Allowlist
from vitserve.rpc.wire import MAX_HEADER_BYTES

MAX_FRAME_BYTES = 2**31  # ZMQ_MAXMSGSIZE never above this, whatever the bound
RCVHWM = 16  # whole messages queued per peer before TCP pushes back
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 5_000, 15_000
# a peer whose ZMTP handshake fails: no key or another key (CURVE), or not ZMTP at all (garbage on the port)
_REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class Router:
    """A bound ROUTER (CURVE server when `key` is given, or admitting by address with `accept_from`: wire_security
    tag) and its monitor; OSError when it cannot bind."""

    def __init__(
        self, endpoint: str, max_bytes: int, key: bytes | None, accept_from: Allowlist | None = None
    ) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, min(max_bytes + MAX_HEADER_BYTES, MAX_FRAME_BYTES))
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._auth = None
        if accept_from is not None:
            self._auth = keys.configure_tagged_server(self.sock, accept_from)
        elif key is not None:
            self._auth = keys.configure_server(self.sock, key)
        self.monitor: zmq.Socket[bytes] | None = None
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"vitserve's connector cannot bind {endpoint!r}: {exc}") from exc
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.monitor = self.sock.get_monitor_socket(_REFUSED_EVENTS)

    def poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        return poller

    def reply(self, peer: zmq.Frame, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a peer that is gone, or not reading: the reply is dropped
            self.sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)

    def failed_handshakes(self) -> list[str]:
        """The names of the handshake failures reported since the last call."""
        failed = []
        while self.monitor is not None and self.monitor.poll(0):
            failed.append(str(zmq.Event(recv_monitor_message(self.monitor)["event"]).name))
        return failed

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
