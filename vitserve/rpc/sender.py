"""LLMSender: vitserve's end of the wire (docs/integration.md) — a ZMQ PUSH socket connected to the LLM server's PULL.

Back-pressure, never loss: when the LLM server reads slowly, ZMQ queues up to the high-water mark and
then a send *blocks* (we poll for POLLOUT; we never send with DONTWAIT-and-drop). A send that is still
blocked at the request's deadline raises vitserve.errors.Timeout (the API answers 504) and nothing of
that message was handed to ZMQ: multipart messages are atomic, so the receiver never sees half of one.
Every message `send_embedding` returned for is delivered while the sender is open; at close, see
`close` for the linger bound and a libzmq limitation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
import zmq

from vitserve.errors import ConfigError, Timeout
from vitserve.rpc.wire import encode_embedding_message

# Messages queued in ZMQ before sends block. Sends are zero-copy, so each queued message keeps its
# embedding alive: 8 x 59 MB (4096 x 3584 float32) = 470 MB at most in the API process.
DEFAULT_SNDHWM = 8
DEFAULT_LINGER_S = 5.0  # how long close() keeps flushing queued messages to a slow/absent receiver


class LLMSender:
    """Pushes wire-format messages (docs/integration.md) to `endpoint` (tcp://host:port or ipc:///path). Thread-safe.

    One lock guards the socket (ZMQ sockets are not thread-safe); the engine calls it from a dedicated
    thread or via asyncio.to_thread. Messages from one thread keep their order; the engine sends a
    request's images one after another, so each request's images arrive in image_index order.
    """

    def __init__(
        self, endpoint: str, *, sndhwm: int = DEFAULT_SNDHWM, linger_s: float = DEFAULT_LINGER_S
    ) -> None:
        self.endpoint = endpoint
        self.linger_s = linger_s
        self.bytes_sent = 0  # header + tensor bytes of every message handed to ZMQ (for the metric)
        self.messages_sent = 0
        self._lock = threading.Lock()
        self._closed = False
        self._init_socket(sndhwm)

    def _init_socket(self, sndhwm: int) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--llm_endpoint must be tcp://host:port or ipc:///path, got {self.endpoint!r}")
        # A private context: close() can then flush and terminate without touching anyone else's sockets.
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.LINGER, int(self.linger_s * 1000))
        try:
            # connect() is asynchronous: messages queue (up to SNDHWM) until the LLM server binds.
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"--llm_endpoint {self.endpoint!r} cannot be connected: {exc}") from exc

    def send_embedding(
        self,
        *,
        request_id: str,
        image_index: int,
        num_images: int,
        image_id: str,
        model: str,
        grid_thw: Sequence[int],
        embedding: torch.Tensor,
        deepstack: Sequence[torch.Tensor] = (),
        deadline: float,
    ) -> int:
        """Hand one image's message to ZMQ, blocking while the receiver is slow; returns bytes sent.

        deadline: time.monotonic() value; raises Timeout if ZMQ has not accepted the message by then.
        """
        frames = encode_embedding_message(
            request_id=request_id,
            image_index=image_index,
            num_images=num_images,
            image_id=image_id,
            model=model,
            grid_thw=grid_thw,
            embedding=embedding,
            deepstack=deepstack,
        )
        return self.send_frames(frames, deadline=deadline)

    def send_frames(self, frames: list[bytes | memoryview], *, deadline: float) -> int:
        """Send pre-encoded frames as one multipart message; see send_embedding."""
        nbytes = sum(memoryview(f).nbytes for f in frames)
        wait_s = min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)
        if not self._lock.acquire(timeout=wait_s):
            raise self._timeout("another send held the socket")
        try:
            if self._closed:
                raise RuntimeError("LLMSender is closed")
            self._send_before(frames, deadline)
            self.bytes_sent += nbytes
            self.messages_sent += 1
        finally:
            self._lock.release()
        return nbytes

    def _send_before(self, frames: list[bytes | memoryview], deadline: float) -> None:
        """Wait for room (POLLOUT) until the deadline, then send without blocking.

        POLLOUT means ZMQ accepts a whole message now: the high-water mark is only checked at the
        first frame, never mid-message, so NOBLOCK fails (zmq.Again) on the first frame or not at all,
        and a refused message left nothing behind. copy=False: ZMQ's I/O thread reads the tensor
        memory directly instead of copying ~60 MB into its own buffer first.
        """
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout("the LLM server did not take the message (it is slow or gone)")
            # poll() takes milliseconds: round up so we never spin on a sub-millisecond remainder, and
            # wake at least every second so a far (or infinite) deadline needs no special case.
            wait_ms = max(1, int(min(remaining, 1.0) * 1000 + 0.999))
            if not self._sock.poll(timeout=wait_ms, flags=zmq.POLLOUT):
                continue
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                continue  # lost a race for the room; nothing was queued, wait again

    def _timeout(self, why: str) -> Timeout:
        return Timeout(
            f"sending an embedding to --llm_endpoint {self.endpoint} did not complete before the request "
            f"deadline (--request_timeout_s): {why}; {self.messages_sent} messages sent so far"
        )

    def close(self) -> None:
        """Close the socket. Queued messages keep flushing for up to linger_s (the LINGER option) —
        bounded, so shutdown cannot hang on a receiver that is gone; what is left after that is lost.

        Known libzmq limitation (libzmq #4660, #3774, #1922; reproduced here on ipc:// with small HWMs):
        if the receiver sits at its RCVHWM when this socket hangs up, the receiving engine can drop
        the tail still in the kernel buffer, even within the linger period. vitserve therefore keeps
        one sender for the life of the service and closes it only at shutdown, after the drain.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=int(self.linger_s * 1000))
            self._ctx.term()

    def __enter__(self) -> LLMSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
