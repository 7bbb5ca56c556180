"""The scheduler side of vitserve's vLLM connector without vLLM (vitserve/connector/glue.py is the glue): a ZMQ
ROUTER that takes vitserve's wire messages (docs/wire.md, "vitserve's vLLM connector") and keeps each embedding,
whole and checked, as a file in shared memory that vLLM's workers read.

Where the bytes live: one file per uuid, `<dir>/<uuid>`, the raw (rows, width) tensor (main rows and every
DeepStack level concatenated along the last dimension) in the message's dtype, written to a temporary name and
renamed, so a worker never sees a partial file. `dir` is a fresh directory under /dev/shm (RAM) by default,
`vitserve-ec-<pid>-*`, removed at close; one whose process is gone (a killed vLLM) is removed at the next start.
vLLM runs its workers in other processes (always on a CPU; with several GPUs too): a file in /dev/shm is the one
thing every process on the host reads without copying through the engine.

The bound: `max_bytes` over the files held. An arrival that does not fit evicts, oldest first, unpinned entries
that are spent: loaded by the request that named them, or past their expiry. An acknowledged entry that no request
has loaded yet is never evicted before its expiry (its sender was told it is kept, and its request may be on its
way): when such entries and pinned ones fill the bound, the arrival is refused (nack). An entry is pinned while a request that names it is
scheduled (glue.py pins it when the request passes ensure_cache_available and unpins it when the
request finishes); an unpinned one is dropped at its expiry (the message's `expires_at`, extended by a holds
query that names it, or by a scheduling attempt). Nothing here ever waits on vLLM's scheduler: the receiver
thread and the scheduler share only `_lock`, held for dictionary updates.

Counters (`counters()`; logged every 30 s when they moved, and at shutdown): received, refused (nack), rejected
(not the wire), handshakes_failed (a peer without the key, or one that speaks no ZMTP: nothing of it is read),
expired, evicted, held_bytes, held.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from vitserve.connector import keys
from vitserve.rpc.replies import HoldsQuery, decode_inbound, encode_held, encode_nack
from vitserve.rpc.tensors import DTYPES, tensor_to_buffer
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_ack

DEFAULT_HOLD_S = 30.0  # a holds query without expires_at keeps what it names this long
TOUCH_S = 10.0  # a scheduling attempt keeps an unpinned entry at least this long
MAX_FRAME_BYTES = 2**31  # ZMQ_MAXMSGSIZE: a forged 100 GB frame is cut before it is allocated
_POLL_MS = 200
_LOG_EVERY_S = 30.0
# a peer whose ZMTP handshake fails: no key or another key (CURVE), or not ZMTP at all (garbage on the port)
_REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass
class HeldTensor:
    """One embedding held: its file and what a request needs to check it against."""

    path: Path
    dtype: str
    rows: int
    width: int
    nbytes: int
    expires_at: float  # Unix time; an unpinned entry past it is dropped
    pins: set[str] = field(default_factory=set)  # request ids that will load it
    loaded: bool = False  # a request that named it finished, and no holds query asked for it since


@dataclass
class Shape:
    """What a message must agree with: the model's width (0: unchecked) and spatial merge."""

    width: int
    merge: int


class EmbeddingStore:
    """Binds `endpoint` and keeps what arrives (see the module docstring); `close()` stops and deletes."""

    def __init__(
        self,
        endpoint: str,
        max_bytes: int,
        shape: Shape,
        *,
        key: bytes | None = None,
        directory: str | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.max_bytes, self.shape = max_bytes, shape
        self.log = log or logging.getLogger(__name__)
        self.entries: dict[str, HeldTensor] = {}  # insertion order = arrival order: eviction takes the oldest
        self.counts = dict.fromkeys(
            ("received", "refused", "rejected", "handshakes_failed", "expired", "evicted"), 0
        )
        self._lock = threading.Lock()
        self._closing = False
        root = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        _remove_orphans(Path(root), self.log)
        self.dir = Path(tempfile.mkdtemp(prefix=f"vitserve-ec-{os.getpid()}-", dir=root))
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._auth = keys.configure_server(self._sock, key) if key is not None else None
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._stop_socket()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise OSError(f"vitserve's connector cannot bind {endpoint!r}: {exc}") from exc
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor = self._sock.get_monitor_socket(_REFUSED_EVENTS)
        self._thread = threading.Thread(target=self._run, name="vitserve-ec-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the scheduler's side (any thread)

    def get(self, uuid: str) -> HeldTensor | None:
        with self._lock:
            return self.entries.get(uuid)

    def touch(self, uuid: str) -> HeldTensor | None:
        """The entry, kept at least TOUCH_S longer (a request is about to name it), or None."""
        with self._lock:
            entry = self.entries.get(uuid)
            if entry is not None:
                entry.expires_at = max(entry.expires_at, time.time() + TOUCH_S)
            return entry

    def pin(self, uuid: str, request_id: str) -> HeldTensor | None:
        with self._lock:
            entry = self.entries.get(uuid)
            if entry is not None:
                entry.pins.add(request_id)
            return entry

    def unpin(self, uuids: set[str], request_id: str) -> None:
        with self._lock:
            for uuid in uuids:
                if (entry := self.entries.get(uuid)) is not None:
                    entry.pins.discard(request_id)
                    entry.loaded = True
                    entry.expires_at = max(entry.expires_at, time.time() + TOUCH_S)

    def counters(self) -> dict[str, int]:
        with self._lock:
            held = sum(e.nbytes for e in self.entries.values())
            return {**self.counts, "held_bytes": held, "held": len(self.entries)}

    def close(self) -> None:
        self._closing = True
        self._thread.join(5)
        self.log.info("vitserve connector on %s closed: %s", self.endpoint, self.counters())
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the receiver thread

    def _run(self) -> None:
        logged, last = time.monotonic(), self.counters()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closing:
                events = dict(poller.poll(_POLL_MS))
                if self._sock in events:
                    self._take(self._sock.recv_multipart(copy=False))
                if self._monitor in events:
                    self._on_monitor()
                self._expire(time.time())
                if time.monotonic() - logged > _LOG_EVERY_S:
                    logged, now = time.monotonic(), self.counters()
                    if now != last:
                        self.log.info("vitserve connector on %s: %s", self.endpoint, now)
                    last = now
        except Exception:
            self.log.exception(
                "vitserve connector on %s: the receiver failed; it takes nothing more", self.endpoint
            )
        finally:
            self._stop_socket()

    def _on_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            self.counts["handshakes_failed"] += 1
            failed = self.counts["handshakes_failed"]
            if failed & (failed - 1):  # a refused peer retries every 100 ms: log the 1st, 2nd, 4th, 8th, ...
                continue
            self.log.warning(
                "vitserve connector on %s: a peer's handshake failed (%s): without the key, or not vitserve's wire; "
                "nothing of it was read (%d so far)",
                self.endpoint,
                zmq.Event(event["event"]).name,
                failed,
            )

    def _stop_socket(self) -> None:
        if hasattr(self, "_monitor"):
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _take(self, frames: list[zmq.Frame]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            message = decode_inbound(body)
        except WireError as exc:
            self.counts["rejected"] += 1
            nbytes = sum(len(f) for f in body)
            self.log.warning(
                "vitserve connector: rejected a message (%d frames, %d bytes): %s", len(body), nbytes, exc
            )
            return
        if isinstance(message, HoldsQuery):
            self._reply(peer, encode_held(self._holds(message), message.query_id))
            return
        reason = self._keep(message)
        if reason is None:
            self.counts["received"] += 1
            self._reply(peer, encode_ack(message.message_id))
        else:
            self.counts["refused"] += 1
            self.log.warning(
                "vitserve connector: refused message %s (request %s, uuid %s): %s",
                message.message_id,
                message.request_id,
                message.uuid,
                reason,
            )
            self._reply(peer, encode_nack(message.message_id, reason))

    def _reply(self, peer: zmq.Frame, frame: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a peer that is gone: the reply is dropped
            self._sock.send_multipart([peer, frame], flags=zmq.NOBLOCK)

    def _holds(self, query: HoldsQuery) -> list[str]:
        until = query.expires_at if query.expires_at is not None else time.time() + DEFAULT_HOLD_S
        with self._lock:
            held = [u for u in query.uuids if u in self.entries]
            for uuid in held:  # promised to a request again: kept like a fresh arrival
                self.entries[uuid].expires_at = max(self.entries[uuid].expires_at, until)
                self.entries[uuid].loaded = False
        return held

    def _keep(self, m: ImageEmbedding) -> str | None:
        """Check and keep one message; None when kept, else why it was refused (nothing of it is kept)."""
        reason = self._check(m)
        if reason is not None:
            return reason
        assert m.uuid is not None
        tensor = torch.cat([m.embedding, *m.deepstack], dim=-1) if m.deepstack else m.embedding
        rows, width = (int(d) for d in tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            held = self.entries.get(m.uuid)
            if held is not None and (held.rows, held.width, held.dtype) == (rows, width, m.dtype):
                held.expires_at = max(held.expires_at, m.expires_at)  # the same embedding again
                held.loaded = False
                return None
            if held is not None and held.pins:
                return f"uuid {m.uuid} is held with another shape and a scheduled request will load it"
            if held is not None:
                self._drop(m.uuid, "")
            if nbytes > self.max_bytes:
                return f"{nbytes} bytes are more than max_gb allows ({self.max_bytes} bytes)"
            if not self._make_room(nbytes):
                return (
                    f"{nbytes} bytes do not fit in max_gb ({self.max_bytes} bytes) beside the tensors "
                    "acknowledged and not yet loaded or expired"
                )
        path = self.dir / m.uuid
        temp = self.dir / f".{m.uuid}.{m.message_id[:32]}.tmp"
        with open(temp, "wb") as f:
            f.write(tensor_to_buffer(tensor))
        os.replace(temp, path)
        with self._lock:
            self.entries[m.uuid] = HeldTensor(path, m.dtype, rows, width, nbytes, m.expires_at)
        return None

    def _check(self, m: ImageEmbedding) -> str | None:
        if m.uuid is None:
            return "the message names no uuid (the connector keeps embeddings by their encoder-cache key)"
        if m.expires_at <= time.time():
            return f"expired {time.time() - m.expires_at:.3f} s ago"
        rows = m.num_tokens
        if any(int(d.shape[0]) != rows for d in m.deepstack):
            return (
                f"deepstack rows {[int(d.shape[0]) for d in m.deepstack]} differ from the embedding's {rows}"
            )
        t, h, w = m.grid_thw
        merge = self.shape.merge
        if rows != t * h * w // (merge * merge) or (h % merge) or (w % merge):
            return (
                f"{rows} rows, but grid {list(m.grid_thw)} with merge {merge} needs {t * h * w // merge**2}"
            )
        width = sum(int(x.shape[1]) for x in (m.embedding, *m.deepstack))
        if self.shape.width and width != self.shape.width:
            return f"width {width}, but this model needs {self.shape.width} (hidden size x (1 + DeepStack levels))"
        return None

    def _make_room(self, nbytes: int) -> bool:
        """Evict spent entries (unpinned, and loaded or expired), oldest first, until nbytes fit (under _lock)."""
        held = sum(e.nbytes for e in self.entries.values())
        now = time.time()
        for uuid in [u for u, e in self.entries.items() if not e.pins and (e.loaded or e.expires_at <= now)]:
            if held + nbytes <= self.max_bytes:
                break
            held -= self.entries[uuid].nbytes
            self._drop(uuid, "evicted")
        return held + nbytes <= self.max_bytes

    def _expire(self, now: float) -> None:
        with self._lock:
            for uuid in [u for u, e in self.entries.items() if not e.pins and e.expires_at <= now]:
                self._drop(uuid, "expired")

    def _drop(self, uuid: str, counter: str) -> None:
        entry = self.entries.pop(uuid)
        with contextlib.suppress(FileNotFoundError):
            entry.path.unlink()
        if counter:
            self.counts[counter] += 1


def _remove_orphans(root: Path, log: logging.Logger) -> None:
    """Directories a killed vLLM left (its pid is in the name and gone): /dev/shm is RAM, up to max_gb each."""
    for orphan in root.glob("vitserve-ec-*-*"):
        pid = orphan.name.split("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(orphan, ignore_errors=True)
        log.warning("vitserve connector: removed %s, left by process %s, which is gone", orphan, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def read_entry(path: str, dtype: str, rows: int, width: int) -> torch.Tensor:
    """A held embedding as a private CPU tensor (the worker's side: a copy, so the file may go at once)."""
    tensor = torch.from_file(path, shared=False, size=rows * width, dtype=DTYPES[dtype])
    return tensor.view(rows, width)


def as_dict(entry: HeldTensor) -> dict[str, Any]:
    return {"path": str(entry.path), "dtype": entry.dtype, "rows": entry.rows, "width": entry.width}
