"""`wire_security: tag`: the wire keyed without encryption (docs/vllm.md "Security"), for a private network where
CURVE's encryption costs more than the bytes' trip (bench/RESULTS.md: ~1.5 s per GB here, 131 ms of one 1080p
embedding at 16,384; AES-GMAC over the same bytes ~16 ms per side).

Every message on the wire gets one more frame, its tag; the other end drops a message whose tag does not verify:

    frame: version (1 byte, 1) | sent at (8 bytes, big-endian nanoseconds since the epoch) | nonce (12 bytes) |
           AES-256-GMAC tag (16 bytes)
    key: sha256("vitserve-tag" + the shared secret)
    authenticated: "vitserve-wire-tag-1 <direction>", the tag frame's first 21 bytes, the number of frames and
                   each frame's length (8 bytes each), then each frame's bytes

The direction ("to-connector" or "to-sender") keeps a reply from being played back as a message. A message sent
more than WINDOW_S away from the receiver's clock, or whose nonce was already seen within the window, is a
replay and is dropped. The bytes themselves travel in clear: anyone on the network can read them, no one without
the secret can forge or change one. Admission by address at the ZMTP handshake (the connector's `accept_from`)
keeps strangers from sending anything at all.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vitserve.rpc.wire import WireError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers import Cipher, modes

VERSION = 1
WINDOW_S = 60.0  # a tag's time may differ this much from the receiver's clock (hosts' clocks: NTP)
# nonces remembered; only messages whose tag verified are, so only a holder of the key fills it
MAX_SEEN = 1_000_000
TO_CONNECTOR, TO_SENDER = "to-connector", "to-sender"
_HEAD = struct.Struct(">BQ12s")  # version, sent at (ns), nonce
TAG_FRAME_BYTES = _HEAD.size + 16


class TagError(WireError):
    """A message whose tag is missing, stale, replayed or does not verify."""


class Tagger:
    """Seals messages in one direction and opens those of the other (both ends hold the same secret)."""

    def __init__(self, secret: bytes, *, sends: str) -> None:
        # imported here: only wire_security tag needs it (the connector's import stays light in vLLM's environment)
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._gcm: Callable[..., Cipher[modes.GCM]]
        aes = algorithms.AES(hashlib.sha256(b"vitserve-tag" + secret).digest())
        self._gcm = lambda nonce, tag=None: Cipher(aes, modes.GCM(nonce, tag))
        self._sends = sends
        self._opens = TO_SENDER if sends == TO_CONNECTOR else TO_CONNECTOR
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it may be forgotten (monotonic)

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """`frames` with their tag frame appended (the frames themselves are not copied)."""
        head = _HEAD.pack(VERSION, time.time_ns(), os.urandom(12))
        sealer = self._gcm(head[-12:]).encryptor()
        self._authenticate(sealer, self._sends, head, frames)
        sealer.finalize()
        return [*frames, head + sealer.tag]

    def open(self, frames: Sequence[Any]) -> list[Any]:
        """The message's frames without its tag frame; TagError when the tag is missing, stale, replayed or
        wrong. A nonce is remembered only once its tag verified."""
        if len(frames) < 2:
            raise TagError("tag: the message has no tag frame (is the sender's --wire_security tag?)")
        *body, tag_frame = frames
        raw = bytes(memoryview(tag_frame))
        if len(raw) != TAG_FRAME_BYTES or raw[0] != VERSION:
            raise TagError(
                f"tag: the last frame is not a tag ({len(raw)} bytes; a tag has {TAG_FRAME_BYTES}, version "
                f"{VERSION}): the sender's wire_security differs, or it is not vitserve's wire"
            )
        head, tag = raw[: _HEAD.size], raw[_HEAD.size :]
        _, sent_ns, nonce = _HEAD.unpack(head)
        skew = abs(time.time_ns() - sent_ns) / 1e9
        if skew > WINDOW_S:
            raise TagError(f"tag: sent {skew:.0f} s away from this host's clock (at most {WINDOW_S:.0f}): a "
                           "replay, or the two hosts' clocks differ (NTP)")  # fmt: skip
        if nonce in self._seen:
            raise TagError("tag: this message was seen before (a replay)")
        opener = self._gcm(nonce, tag).decryptor()
        self._authenticate(opener, self._opens, head, body)
        try:
            opener.finalize()
        except Exception:  # cryptography's InvalidTag
            raise TagError(
                "tag: the tag does not verify: the two ends hold different secrets (key_file, --wire_key_file), "
                "or the message was changed on the way"
            ) from None
        self._remember(nonce)
        return body

    def _authenticate(self, gcm: Any, direction: str, head: bytes, frames: Sequence[Any]) -> None:
        lengths = [memoryview(f).nbytes for f in frames]
        gcm.authenticate_additional_data(f"vitserve-wire-tag-{VERSION} {direction}".encode() + head)
        gcm.authenticate_additional_data(struct.pack(f">I{len(lengths)}Q", len(lengths), *lengths))
        for frame in frames:
            view = memoryview(frame)
            if view.nbytes:
                gcm.authenticate_additional_data(
                    view.cast("B") if view.ndim != 1 or view.itemsize != 1 else view
                )

    def _remember(self, nonce: bytes) -> None:
        now = time.monotonic()
        self._seen[nonce] = now + 2 * WINDOW_S  # a time within +-WINDOW_S of the clock is taken for 2 windows
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) > MAX_SEEN):
            self._seen.popitem(last=False)
