"""EmbeddingReceiver: the LLM server's end of the wire (docs/wire.md), shipped with vitserve for LLM-server authors.

    from vitserve.rpc import EmbeddingReceiver
    with EmbeddingReceiver("ipc:///tmp/llm.sock") as rx:     # binds a ROUTER socket; vitserve connects
        emb = rx.recv(timeout_s=1.0)                          # ImageEmbedding, or TimeoutError
        emb.embedding                                         # (num_tokens, dim) torch.Tensor

recv() acknowledges each message as it hands it over; vitserve answers /encode 200 only once every image
of the request was acknowledged. A message past its expires_at is dropped (counted in `.expired`, one
log line), never returned: its request has already failed. A second copy of a message already returned
(same message_id; vitserve sends one again after a reconnect) is acknowledged again and dropped
(`.duplicates`). Messages that are not wire-format v2 (garbage, a pickle, an unknown version, sizes that
do not match the header) are rejected with one logged error line — the reason, never payload bytes — and
recv() goes on to the next message. Nothing received is ever unpickled or executed.

Tensors share memory with the received ZMQ frames (no copy after the kernel's): each message owns its
frames, so the tensors are the receiver's to keep or modify.

Throughput tip (glibc): libzmq mallocs a fresh buffer per received frame, and frames over glibc's mmap
threshold (32 MB at most) get fresh pages that fault in on every message. Starting the LLM server with
`MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=2000000000` lets freed buffers be reused:
about 2x the bandwidth for 59 MB frames in paired runs on a loaded VM (bench/history/0.1.0.md, "Transfer").
It is process-wide, so vitserve does not set it for you.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time

import zmq

from vitserve.rpc.wire import ImageEmbedding, WireError, decode_embedding_message, encode_ack

log = logging.getLogger(__name__)

DEFAULT_RCVHWM = 8  # messages ZMQ buffers here before the sender's queue fills (8 x 59 MB at most)
_POLL_SLICE_S = 0.2  # longest single wait in recv(); bounds how long close() waits for a blocked recv()
_ACK_LINGER_MS = 1000  # close() waits at most this long for queued acknowledgements to leave
MAX_REMEMBERED_IDS = 100_000  # message ids kept for duplicate detection (each only until it expires)


class EmbeddingReceiver:
    """A ROUTER socket that yields ImageEmbedding messages and acknowledges each one it returns.

    endpoint: tcp://host:port or ipc:///path; with bind=True "tcp://127.0.0.1:*" picks a free port,
    and `.endpoint` is the address actually bound.
    bind: True (the default: the LLM server binds) or False to connect.
    rcvhwm: messages ZMQ buffers here before back-pressure reaches the sender.
    max_frame_bytes: ZMQ_MAXMSGSIZE; a peer sending a larger frame is disconnected before the frame
      is allocated (guards an exposed endpoint against a forged 100 GB frame). None = no limit: a
      (4096, 3584) float32 embedding is 59 MB, so size it to your largest image, not a guess.
    """

    def __init__(
        self,
        endpoint: str,
        bind: bool = True,
        *,
        rcvhwm: int = DEFAULT_RCVHWM,
        max_frame_bytes: int | None = None,
    ) -> None:
        self.received = 0  # good messages returned (and acknowledged) by recv()
        self.rejected = 0  # bad messages logged and skipped
        self.expired = 0  # messages past their expires_at, logged and dropped
        self.duplicates = 0  # second copies of a returned message, acknowledged again and dropped
        self._seen: dict[str, float] = {}  # message_id -> expires_at, of messages returned
        self._seen_order: list[tuple[float, str]] = []  # heap by expiry, to forget ids once expired
        self._lock = threading.Lock()
        self._closing = False
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if max_frame_bytes is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        try:
            if bind:
                self._sock.bind(endpoint)
                endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(
                f"cannot {'bind' if bind else 'connect'} the embedding receiver at {endpoint!r}: {exc}"
            ) from exc
        self.endpoint = endpoint

    def recv(self, timeout_s: float | None = None) -> ImageEmbedding:
        """The next well-formed, unexpired, new message, acknowledged to its sender. Raises TimeoutError
        if none arrives within timeout_s (None waits forever); bad, expired and duplicate messages in
        between are logged, counted and skipped. Raises RuntimeError once the receiver is closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                peer, *frames = self._recv_frames(deadline, timeout_s)
                msg = self._accept(peer, frames)
                if msg is not None:
                    self._ack(peer, msg.message_id)
                    self.received += 1
                    return msg

    def _accept(self, peer: zmq.Frame, frames: list[zmq.Frame]) -> ImageEmbedding | None:
        """The message if the application should get it; None (logged and counted) if not."""
        try:
            msg = decode_embedding_message(frames)
        except WireError as exc:
            self.rejected += 1
            nbytes = sum(len(f) for f in frames)
            log.error(
                "rejected a message on %s (%d frames, %d bytes): %s", self.endpoint, len(frames), nbytes, exc
            )
            return None
        now = time.time()
        if msg.expires_at <= now:
            self.expired += 1
            log.warning(
                "dropped an expired message on %s: request %s image %d expired %.3f s ago",
                self.endpoint,
                msg.request_id,
                msg.image_index,
                now - msg.expires_at,
            )
            return None
        self._forget_expired(now)
        if msg.message_id in self._seen:
            self.duplicates += 1
            self._ack(peer, msg.message_id)  # its sender missed the first acknowledgement
            log.info("dropped a duplicate of message %s (request %s)", msg.message_id, msg.request_id)
            return None
        self._seen[msg.message_id] = msg.expires_at
        heapq.heappush(self._seen_order, (msg.expires_at, msg.message_id))
        return msg

    def _forget_expired(self, now: float) -> None:
        """An id is remembered until its message expires: a later copy is dropped as expired anyway."""
        order = self._seen_order
        while order and (order[0][0] <= now or len(order) > MAX_REMEMBERED_IDS):
            self._seen.pop(heapq.heappop(order)[1], None)

    def _ack(self, peer: zmq.Frame, message_id: str) -> None:
        """ROUTER sends never block: to a sender that is gone, the acknowledgement is discarded."""
        self._sock.send_multipart([peer, encode_ack(message_id)], flags=zmq.NOBLOCK)

    def _recv_frames(self, deadline: float | None, timeout_s: float | None) -> list[zmq.Frame]:
        while True:
            if self._closing:
                raise RuntimeError(f"EmbeddingReceiver on {self.endpoint} is closed")
            remaining = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no embedding message on {self.endpoint} within {timeout_s} s")
            # Poll in slices, so close() from another thread ends a recv() that waits forever.
            wait_ms = max(1, int(min(remaining, _POLL_SLICE_S) * 1000 + 0.999))
            if self._sock.poll(timeout=wait_ms, flags=zmq.POLLIN):
                # copy=False: frames keep ZMQ's receive buffers; tensors are built over them in place.
                return self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        """Close the socket; a recv() waiting in another thread raises RuntimeError within 0.2 s."""
        self._closing = True
        with self._lock:
            if not self._sock.closed:
                self._sock.close(linger=_ACK_LINGER_MS)  # acks of returned messages still go out
                self._ctx.term()

    def __enter__(self) -> EmbeddingReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m vitserve.rpc.receiver --bind ENDPOINT`: a stand-in LLM side that prints one line per image
    (and acknowledges it).

    Used by docker/compose.yaml to show the sidecar wiring; stops after --count messages (0 = never).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m vitserve.rpc.receiver", description=main.__doc__)
    parser.add_argument("--bind", required=True, help="endpoint to bind, e.g. ipc:///run/vitserve/llm.sock")
    parser.add_argument(
        "--count", type=int, default=0, help="exit after this many messages (0 = run forever)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with EmbeddingReceiver(args.bind, bind=True) as rx:
        print(json.dumps({"listening": rx.endpoint}), flush=True)
        while args.count <= 0 or rx.received < args.count:
            emb = rx.recv()
            print(
                json.dumps(
                    {
                        "request_id": emb.request_id,
                        "message_id": emb.message_id,
                        "image_index": emb.image_index,
                        "num_images": emb.num_images,
                        "image_id": emb.image_id,
                        "model": emb.model,
                        "grid_thw": list(emb.grid_thw),
                        "shape": list(emb.embedding.shape),
                        "dtype": emb.dtype,
                        "deepstack": len(emb.deepstack),
                        "video": None if emb.video is None else emb.video.to_header(),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
