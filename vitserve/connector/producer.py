"""The producer's end of a pull (SPEC §13; rpc/pull.py has the messages): a ZMQ ROUTER that answers each fetch
query with the embedding message it holds under that uuid, or `missing` with a reason.

What it holds is someone else's: `find(uuid)` returns the message to send (or None). A query that names the
connector's incoming area is answered by `to_file(area, message)` when it is given and returns a file message's
frame (the connector is on this host: rpc/pull.py), else with the bytes. vitserve's
`--llm_transport pull` backs it by its bounded store; tests by a dict. The answer's `message_id` is the query's id
(the fetcher matches on it); nothing else of the held message changes, its `expires_at` included, so the
consumer keeps it no longer than the producer would.

With a key (`--wire_key_file`) the ROUTER is a CURVE server that admits only the client key derived from the same
secret (vitserve/connector/keys.py): a fetcher without it fails the handshake and is never answered. The thread
survives every message: a query that is not the wire is counted and dropped (it names no query to answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable

import zmq

from vitserve.connector import keys
from vitserve.rpc.pull import Area, decode_fetch, encode_missing
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_embedding_message

MAX_QUERY_BYTES = 64 * 1024  # a fetch query is ~100 bytes: a bigger frame is cut before it is allocated
_POLL_MS = 200


class Producer:
    """Binds `endpoint` and answers fetch queries from `find` on a thread of its own; `close()` stops it."""

    def __init__(
        self,
        endpoint: str,
        find: Callable[[str], ImageEmbedding | None],
        *,
        key: bytes | None = None,
        log: logging.Logger | None = None,
        to_file: Callable[[Area, ImageEmbedding], bytes | None] | None = None,
    ) -> None:
        self.find, self.to_file = find, to_file
        self.log = log or logging.getLogger(__name__)
        self.counts = dict.fromkeys(("served", "files", "missing", "rejected"), 0)  # files: of served
        self._closing = False
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth = keys.configure_server(self._sock, key) if key is not None else None
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._stop_socket()
            raise OSError(f"vitserve's pull producer cannot bind {endpoint!r}: {exc}") from exc
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="vitserve-pull-producer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._closing:
                if self._sock.poll(_POLL_MS, zmq.POLLIN):
                    self._answer(self._sock.recv_multipart(copy=False))
        except Exception:
            self.log.exception("vitserve pull producer on %s failed; it answers nothing more", self.endpoint)
        finally:
            self._stop_socket()

    def _answer(self, frames: list[zmq.Frame]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            query = decode_fetch(body)
        except WireError as exc:
            self.counts["rejected"] += 1
            self.log.warning("vitserve pull producer: rejected a query (%d frames): %s", len(body), exc)
            return
        message = self.find(query.uuid)
        reply: list[bytes | memoryview]
        if message is None or message.uuid != query.uuid:
            self.counts["missing"] += 1
            reply = [
                encode_missing(query.uuid, query.query_id, "not held here (never kept, expired or released)")
            ]
        else:
            self.counts["served"] += 1
            message = dataclasses.replace(message, message_id=query.query_id)
            file = self._file(query.area, message)
            self.counts["files"] += file is not None
            reply = [file] if file is not None else encode_embedding_message(message)
        with contextlib.suppress(zmq.ZMQError):  # a fetcher that is gone: the answer is dropped
            self._sock.send_multipart([peer, *reply], flags=zmq.NOBLOCK, copy=False)

    def _file(self, area: Area | None, message: ImageEmbedding) -> bytes | None:
        if area is None or self.to_file is None:
            return None
        try:
            return self.to_file(area, message)
        except Exception:  # a failed write (ENOSPC, ...): the bytes go instead
            self.log.warning("vitserve pull producer: writing %s into %s failed; sending its bytes",
                             message.uuid, area.incoming, exc_info=True)  # fmt: skip
            return None

    def _stop_socket(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
