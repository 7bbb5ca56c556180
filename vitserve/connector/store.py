"""The scheduler side of vitserve's vLLM connector without vLLM (vitserve/connector/glue.py is the glue): a ZMQ
ROUTER that takes vitserve's wire messages (docs/wire.md, "vitserve's vLLM connector") and keeps each embedding,
whole and checked, as a file in shared memory that vLLM's workers read.

The receiver cannot die of a message: each one is taken on its own, and whatever goes wrong with it (a shape, a full
device, a file that cannot be written, a bug) is a nack whose reason starts with a code of checks.REASONS, a
counter, and at most one log line per reason every 10 s; nothing of that message is kept (no file, no temporary
file) and the next message is taken. Should the receiver's loop fail anyway (its socket, say), a supervisor in the
same thread rebuilds the socket and starts it again (`receiver_restarts`); `failure_since(t)` tells the glue, so a
request waiting for an item fails at once instead of at its deadline.

Where the bytes live: files.py (one file per uuid, named by its sha256, in a locked `vitserve-ec-<pid>-*`
directory). The bound: `max_bytes`, lowered at start to the device's free space (with a warning naming both and
Docker's `--shm-size`); an ENOSPC all the same evicts what is spent, retries once, and is refused (`device_full`).
Who needs an entry and what may go: ledger.py (O(1) per arrival); no expiry is set past now + `max_hold_s`. The
receiver thread and vLLM's scheduler share only `_lock`, held for bookkeeping, never for I/O.

A peer cannot hold the engine's memory: router.py sets ZMQ's limits (message size, queue, heartbeats), and a
keyless connector binds only an endpoint of this host (protected mode; `allow_unauthenticated` lifts it, with a
warning), since libzmq cannot bound the frames of one unfinished multipart message.

Same host: a file vitserve wrote into the incoming area is checked and adopted by a rename (handoff.py).
Counters (`counters()`, stable names, logged once a minute while they move and at close): COUNTERS below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import zmq

from vitserve.connector.allowlist import Allowlist
from vitserve.connector.checks import REASONS, RateLimitedLog, Refusal, Shape, check_message
from vitserve.connector.files import TensorDir, file_name, is_device_full, read_entry
from vitserve.connector.handoff import Incoming, check_file
from vitserve.connector.keys import check_protected
from vitserve.connector.ledger import HeldTensor, Ledger, as_dict
from vitserve.connector.router import Router
from vitserve.rpc.handoff import FileEmbedding, Hello, decode_handoff
from vitserve.rpc.pull import Area
from vitserve.rpc.replies import HoldsQuery, Release, decode_inbound, encode_held, encode_nack, message_id_of
from vitserve.rpc.tag import TO_SENDER, Tagger
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_ack

__all__ = ["COUNTERS", "REASONS", "EmbeddingStore", "HeldTensor", "Shape", "as_dict", "read_entry"]

DEFAULT_MAX_HOLD_S = 300.0  # the longest an entry is kept unpinned past its last push, holds query or touch
DEFAULT_HOLD_S = 30.0  # a holds query without expires_at keeps what it names this long
TOUCH_S = 10.0  # a scheduling attempt keeps an unpinned entry at least this long
# what became of what arrived: acknowledged, nacked (also refused_<code> per code of checks.REASONS), not the wire
# (garbage, or malformed: nacked when it names a message id), a handshake that failed (no key, not ZMTP)
_MESSAGES = ("received", "adopted", "refused", "rejected", "handshakes_failed")  # adopted: of received, files
_ENTRIES = ("evicted", "expired", "releases", "receiver_restarts")  # what became of what was held
COUNTERS = (*_MESSAGES, *_ENTRIES, *(f"refused_{code}" for code in REASONS))  # + held, held_bytes, max_bytes
_POLL_MS = 200
_LOG_EVERY_S = 60.0


class EmbeddingStore:
    """Binds `endpoint` and keeps what arrives (see the module docstring); `close()` stops and deletes."""

    def __init__(
        self,
        endpoint: str | None,
        max_bytes: int,
        shape: Shape,
        *,
        key: bytes | None = None,
        directory: str | None = None,
        log: logging.Logger | None = None,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
        allow_unauthenticated: bool = False,
        dtype: str = "",  # the dtype vLLM serves, said to vitserve (rpc/handoff.py info)
        # given: wire_security tag (rpc/tag.py), the addresses of the senders admitted
        accept_from: Allowlist | None = None,
    ) -> None:
        self.shape, self.max_hold_s, self._key, self.dtype = shape, float(max_hold_s), key, dtype
        self._accept_from = accept_from
        if accept_from is not None and key is None:
            raise ValueError("wire_security tag tags each message with key_file's secret: set key_file")
        self._tagger = Tagger(key, sends=TO_SENDER) if accept_from is not None and key is not None else None
        self.log = log or logging.getLogger(__name__)
        if endpoint is not None:
            check_protected(endpoint, key, allow_unauthenticated, self.log)
        self._init_state()
        self._init_dir(directory, max_bytes)
        self.endpoint = ""  # None: pull only (connector/pulling.py keeps through `accept`), nothing bound
        self._thread: threading.Thread | None = None
        if endpoint is not None:
            self._init_socket(endpoint)
            self._thread = threading.Thread(target=self._supervise, name="vitserve-ec-receiver", daemon=True)
            self._thread.start()

    def _init_state(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._closing = False
        self._failure: tuple[float, str] | None = None  # (time.monotonic(), why) of the last restart
        self._say = RateLimitedLog(self.log)
        self._router: Router | None = None

    def _init_dir(self, directory: str | None, max_bytes: int) -> None:
        root = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self._dir = TensorDir(Path(root), self.log)
        self.dir = self._dir.path
        free = self._dir.free_bytes()
        if max_bytes > free:
            self.log.warning(
                "vitserve connector: max_gb asks for %d bytes, but %s has %d bytes free: the bound is %d bytes. "
                "Give the device more (Docker: --shm-size, e.g. --shm-size=8g) or lower max_gb",
                *(max_bytes, root, free, free),
            )
        self.max_bytes = min(max_bytes, free)
        self._incoming = Incoming(self.dir, self.dtype, self.shape.width, self.max_bytes)  # same host's area
        self._ledger = Ledger(self.max_bytes)

    def _init_socket(self, endpoint: str) -> None:
        try:
            self._router = Router(endpoint, self.max_bytes, self._key, self._accept_from)
        except BaseException:
            self._dir.close()
            raise
        self.endpoint = self._router.endpoint

    # ------------------------------------------------------------------ the scheduler's side (any thread)

    def get(self, uuid: str) -> HeldTensor | None:
        with self._lock:
            return self._ledger.entries.get(uuid)

    def touch(self, uuid: str) -> HeldTensor | None:
        """The entry, kept at least TOUCH_S longer (a request is about to name it), or None."""
        with self._lock:
            return self._ledger.touch(uuid, time.time() + min(TOUCH_S, self.max_hold_s))

    def pin(self, uuid: str, request_id: str) -> HeldTensor | None:
        with self._lock:
            return self._ledger.pin(uuid, request_id, time.time())

    def unpin(self, uuids: set[str], request_id: str) -> None:
        """The vLLM request finished: its pins end, and so does the oldest push's claim on each."""
        now = time.time()
        with self._lock:
            for uuid in uuids:
                self._ledger.unpin(uuid, request_id, now + min(TOUCH_S, self.max_hold_s), now)

    def accept(self, m: ImageEmbedding | FileEmbedding) -> str | None:
        """Keep a message that came another way than the receiver (a pull's fetch: its bytes, or a file the
        producer wrote into the incoming area), with the same checks and counters as a push; None when kept, else
        why not (a file not kept is the caller's to remove)."""
        try:
            self._keep(m)
        except Refusal as refusal:
            self.counts["refused"] += 1
            self.counts[f"refused_{refusal.code}"] += 1
            return str(refusal)
        self.counts["received"] += 1
        self.counts["adopted"] += isinstance(m, FileEmbedding)
        return None

    def area(self) -> Area:
        """Where a producer on this host may write a pull's answer (rpc/pull.py)."""
        incoming = self._incoming
        return Area(str(incoming.path), str(incoming.token_file), incoming.token)

    def counters(self) -> dict[str, int | float]:
        with self._lock:
            held = {"held": len(self._ledger.entries), "held_bytes": self._ledger.held_bytes}
            return {**self.counts, **held, "max_bytes": self.max_bytes, **self._incoming.pool.counters()}

    def failure_since(self, t: float) -> str | None:
        """Why the receiver failed after `t` (time.monotonic()), or None: messages in flight then were lost."""
        if self._thread is not None and not self._thread.is_alive() and not self._closing:
            return "vitserve connector: its receiver thread ended"
        failure = self._failure
        return failure[1] if failure is not None and failure[0] > t else None

    def close(self) -> None:
        self._closing = True
        if self._thread is not None:
            self._thread.join(5)
        self.log.info("vitserve connector on %s closed: %s", self.endpoint, self.counters())
        self._incoming.close()
        self._dir.close()

    # ------------------------------------------------------------------ the receiver thread

    def _supervise(self) -> None:
        """Serve until close; a failure of the loop itself is logged, counted and the loop started again."""
        restarts_in_a_row = 0
        while not self._closing:
            started = time.monotonic()
            try:
                self._serve()
            except Exception as exc:
                if self._closing:
                    break
                restarts_in_a_row = 1 if time.monotonic() - started > 10 else restarts_in_a_row + 1
                self._on_failure(exc, restarts_in_a_row)
        self._stop_socket()

    def _serve(self) -> None:
        if self._router is None:  # the one before failed: a fresh one on the same address
            self._router = Router(self.endpoint, self.max_bytes, self._key, self._accept_from)
        router, poller = self._router, self._router.poller()
        logged, last = time.monotonic(), self.counters()
        while not self._closing:
            events = dict(poller.poll(_POLL_MS))  # 1) wait for a message or a refused handshake
            if router.sock in events:
                self._take(router.sock.recv_multipart(copy=False))  # 2) take one message, whatever it holds
            if router.monitor in events:
                self._on_monitor(router.failed_handshakes())  # 3) count refused handshakes
            self._sweep()  # 4) drop what expired
            if time.monotonic() - logged > _LOG_EVERY_S:  # 5) the counters, once a minute while they move
                logged, now = time.monotonic(), self.counters()
                if now != last:
                    self.log.info("vitserve connector on %s: %s", self.endpoint, now)
                last = now

    def _on_failure(self, exc: Exception, in_a_row: int) -> None:
        why = f"vitserve connector: its receiver failed ({type(exc).__name__}: {exc}) and was restarted"
        self._failure = (time.monotonic(), why)
        self.counts["receiver_restarts"] += 1
        self._say("restart", logging.ERROR, "%s", why, exc_info=True)
        with contextlib.suppress(Exception):  # the supervisor itself must not fail on its way back
            if isinstance(exc, zmq.ZMQError):
                self._stop_socket()  # the next _serve binds a fresh one
            self._dir.remove_temp()
        time.sleep(min(0.05 * 2**in_a_row, 2.0))  # a failure that repeats at once does not spin

    def _stop_socket(self) -> None:
        if self._router is not None:
            self._router.close()
            self._router = None

    def _on_monitor(self, failed: list[str]) -> None:
        for event in failed:
            self.counts["handshakes_failed"] += 1
            self._say(
                "handshake",
                logging.WARNING,
                "vitserve connector on %s: a peer's handshake failed (%s): without the key, from an address "
                "accept_from does not admit, or not vitserve's wire; nothing of it was read (%d so far)",
                self.endpoint,
                event,
                self.counts["handshakes_failed"],
            )

    def _take(self, frames: list[zmq.Frame]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            if self._tagger is not None:  # wire_security tag: nothing is read before the tag verified
                body = self._tagger.open(body)
            message = decode_handoff(body) or decode_inbound(body)
        except Exception as exc:  # WireError, or a decoder bug: either way the message is not the wire
            self._reject(peer, body, exc)
            return
        try:
            if isinstance(message, Hello):
                self._reply(peer, self._incoming.info(message.query_id))
            elif isinstance(message, HoldsQuery):
                self._reply(peer, encode_held(self._holds(message), message.query_id))
            elif isinstance(message, Release):
                self._release(message)
            else:
                self._take_embedding(peer, message)
        except Exception:  # a bug: that message is lost, never the receiver
            self._say(
                "internal", logging.ERROR, "vitserve connector: failed to take a message", exc_info=True
            )

    def _take_embedding(self, peer: zmq.Frame, m: ImageEmbedding | FileEmbedding) -> None:
        try:
            self._keep(m)
        except Refusal as refusal:
            self._refuse(peer, m, refusal)
            return
        except Exception as exc:
            self._say(
                "internal", logging.ERROR, "vitserve connector: failed to take a message", exc_info=True
            )
            self._refuse(peer, m, Refusal("internal", f"{type(exc).__name__}: {str(exc)[:200]}"))
            return
        finally:
            if isinstance(m, FileEmbedding):
                self._incoming.discard(m.name)  # adopted (gone already), or refused: nothing is left behind
        self.counts["received"] += 1
        self.counts["adopted"] += isinstance(m, FileEmbedding)  # the same-host hand-over's (handoff.py)
        self._reply(peer, encode_ack(m.message_id))

    def _reject(self, peer: zmq.Frame, body: list[zmq.Frame], exc: Exception) -> None:
        self.counts["rejected"] += 1
        why = str(exc) if isinstance(exc, WireError) else f"{type(exc).__name__} while decoding"
        shape = (len(body), sum(len(f) for f in body))
        self._say("rejected", logging.WARNING, "vitserve connector: rejected a message (%d frames, %d bytes): %s",
                  *shape, why)  # fmt: skip
        message_id = message_id_of(body)
        if message_id is not None:
            self._reply(peer, encode_nack(message_id, f"malformed: {why}"))

    def _refuse(self, peer: zmq.Frame, m: ImageEmbedding | FileEmbedding, refusal: Refusal) -> None:
        self.counts["refused"] += 1
        self.counts[f"refused_{refusal.code}"] += 1
        self._say(
            refusal.code,
            logging.WARNING,
            "vitserve connector: refused message %.64r (request %.64r, uuid %.80r): %s",
            m.message_id,
            m.request_id,
            m.uuid,
            str(refusal),
        )
        self._reply(peer, encode_nack(m.message_id, str(refusal)))

    def _reply(self, peer: zmq.Frame, frame: bytes) -> None:
        assert self._router is not None
        self._router.reply(peer, [frame] if self._tagger is None else self._tagger.seal([frame]))

    def _holds(self, query: HoldsQuery) -> list[str]:
        now = time.time()
        until = query.expires_at if query.expires_at is not None else now + DEFAULT_HOLD_S
        until = min(until, now + self.max_hold_s)
        with self._lock:
            return [uuid for uuid in query.uuids if self._ledger.promise(uuid, until, now)]

    def _release(self, message: Release) -> None:
        self.counts["releases"] += 1
        now = time.time()
        with self._lock:
            for uuid in message.uuids:
                self._ledger.release(uuid, message.request_id, now)

    def _keep(self, m: ImageEmbedding | FileEmbedding) -> None:
        """Check and keep one message; Refusal when it cannot be kept (and nothing of it is)."""
        now = time.time()
        check = check_file if isinstance(m, FileEmbedding) else check_message
        rows, width, nbytes = check(m, self.shape, now)  # type: ignore[arg-type]
        if nbytes > self.max_bytes:
            raise Refusal(
                "too_large", f"{nbytes} bytes are more than the bound ({self.max_bytes} bytes, max_gb)"
            )
        uuid, expires_at = str(m.uuid), min(m.expires_at, now + self.max_hold_s)
        with self._lock:
            held = self._ledger.entries.get(uuid)
            if held is not None and (held.rows, held.width, held.dtype) == (rows, width, m.dtype):
                self._ledger.renew(uuid, m.request_id, expires_at, now)  # the same embedding again
                return
            if held is not None and held.pins:
                raise Refusal(
                    "conflict",
                    f"held as {held.rows} x {held.width} {held.dtype}, and a scheduled request will load it",
                )
            replaced = [self._ledger.remove(uuid)] if held is not None else []
            fits, expired, evicted = self._ledger.make_room(nbytes, now)
            self._tally(expired=expired, evicted=evicted)
        self._delete(replaced + expired + evicted)
        if not fits:
            raise Refusal(
                "full",
                f"{nbytes} bytes do not fit in the bound ({self.max_bytes} bytes, max_gb) beside the tensors "
                "acknowledged and not yet loaded, pinned or promised",
            )
        path = self._write(uuid, m, rows, nbytes)
        with self._lock:
            self._ledger.add(
                uuid, HeldTensor(path, m.dtype, rows, width, nbytes, expires_at), m.request_id, now
            )

    def _write(self, uuid: str, m: ImageEmbedding | FileEmbedding, rows: int, nbytes: int) -> Path:
        """The file, written (or vitserve's, adopted); on ENOSPC, evict spent entries and try once more."""
        if isinstance(m, FileEmbedding):  # the same-host hand-over: vitserve wrote it, it becomes ours
            return self._incoming.adopt(m, self._dir.path / file_name(uuid))
        for attempt in (1, 2):
            try:
                return self._dir.write(uuid, [m.embedding, *m.deepstack], rows)
            except OSError as exc:
                if not is_device_full(exc):
                    raise Refusal("write_failed", f"{self.dir}: {exc.strerror or exc}") from exc
                if attempt == 2:
                    raise Refusal(
                        "device_full",
                        f"the device of {self.dir} is full (ENOSPC) for {nbytes} bytes, also after evicting what was "
                        f"spent ({self._dir.free_bytes()} bytes free, bound {self.max_bytes}): give it more "
                        "(Docker: --shm-size) or lower max_gb",
                    ) from exc
            with self._lock:
                evicted = self._ledger.evict(nbytes)
                self._tally(evicted=evicted)
            self._delete(evicted)
            self._incoming.pool.drain()  # what was evicted went to the pool: the device needs its pages now
        raise AssertionError("unreachable")

    def _sweep(self) -> None:
        self._incoming.sweep()
        with self._lock:
            expired = self._ledger.expire(time.time())
            self._tally(expired=expired)
        self._delete(expired)

    def _tally(self, **taken: list[HeldTensor]) -> None:
        """Count what the ledger let go, under the lock that took it out: a reader that no longer finds an entry
        finds it counted."""
        for counter, entries in taken.items():
            self.counts[counter] += len(entries)

    def _delete(self, entries: list[HeldTensor]) -> None:
        """The files of entries the ledger let go: kept in the pool for vitserve's next same-host write (pool.py), or
        deleted."""
        self._incoming.pool.take(e.path for e in entries)
