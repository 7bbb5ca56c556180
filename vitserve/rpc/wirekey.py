"""The wire's shared secret (`key_file` of vitserve's vLLM connector, `--wire_key_file` of vitserve): ZMQ's own
CURVE security with both keypairs derived from one secret, so a single file configures both ends.

    server secret key = sha256("vitserve-server" + secret), client secret key = sha256("vitserve-client" + secret)
    (32 bytes each, Curve25519), public keys from them (zmq.curve_public)

The connector's ROUTER is a CURVE server whose ZAP handler admits only the derived client public key
(vitserve/connector/keys.py): a peer without the secret fails the handshake, and nothing it sends is ever read.
Traffic is encrypted too.

    sock = ctx.socket(zmq.DEALER); configure_client(sock, read_key_file(path)); sock.connect(endpoint)

`wire_security` says how the secret is used on the push wire: "curve" (the default: the above) or "tag" (no CURVE:
every message carries a tag made with the secret and the connector admits peers by address; rpc/tag.py). A
`Tagged` socket seals what it sends: the sender's code sends through it as through the socket.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from vitserve.rpc.tag import TO_CONNECTOR, Tagger

MIN_SECRET_BYTES = 16
ZAP_DOMAIN = "vitserve"


def read_key_file(path: str | Path) -> bytes:
    """The secret in `path` (surrounding whitespace removed); ValueError when it is too short to be one."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the wire key file {path} holds {len(secret)} bytes; a secret needs {MIN_SECRET_BYTES}+"
        )
    return secret


def keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of `role` ("server" or "client") for this shared secret."""
    secret_key = z85.encode(hashlib.sha256(b"vitserve-" + role.encode() + secret).digest())
    return zmq.curve_public(secret_key), secret_key


def configure_client(sock: zmq.Socket[bytes], secret: bytes) -> None:
    """Make `sock` (vitserve's DEALER) a CURVE client of the connector keyed by `secret`; before connect()."""
    public, secret_key = keypair(secret, "client")
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_serverkey = keypair(secret, "server")[0]


def configure_dealer(sock: zmq.Socket[bytes], secret: bytes, security: str) -> Tagger | None:
    """Key vitserve's DEALER to the connector before connect(): CURVE keys on the socket ("curve"), or nothing on
    it and the Tagger that seals its messages and opens the replies ("tag")."""
    if security == "tag":
        return Tagger(secret, sends=TO_CONNECTOR)
    configure_client(sock, secret)
    return None


class Tagged:
    """A DEALER whose every message is sealed by a Tagger (`send` and `send_multipart` as zmq's)."""

    def __init__(self, sock: zmq.Socket[bytes], tagger: Tagger) -> None:
        self.sock, self.tagger = sock, tagger

    def send(self, frame: Any, flags: int = 0, **kwargs: Any) -> None:
        self.send_multipart([frame], flags, **kwargs)

    def send_multipart(self, frames: list[Any], flags: int = 0, **kwargs: Any) -> None:
        self.sock.send_multipart(self.tagger.seal(frames), flags, **kwargs)
