"""The connector's side of the wire's shared secret (vitserve/rpc/wirekey.py derives both keypairs from it):
the connector's ROUTER is a CURVE server whose ZAP handler admits only the client public key derived from the
same secret, so a peer without it fails the handshake and nothing it sends is ever read."""

from __future__ import annotations

import logging

import zmq
import zmq.auth.thread

from vitserve.connector.allowlist import Allowlist
from vitserve.endpoints import host_only
from vitserve.rpc.wirekey import ZAP_DOMAIN, keypair

log = logging.getLogger(__name__)


def configure_server(sock: zmq.Socket[bytes], secret: bytes) -> zmq.auth.thread.ThreadAuthenticator:
    """Make `sock` (the connector's ROUTER) a CURVE server keyed by `secret`, before bind(), and start the ZAP
    handler on its context that admits only the client key derived from the same secret. The caller stops the
    returned authenticator when it closes the socket."""
    auth = zmq.auth.thread.ThreadAuthenticator(sock.context, log=log)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(keypair(secret, "client")[0]))
    public, secret_key = keypair(secret, "server")
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def configure_tagged_server(
    sock: zmq.Socket[bytes], accept_from: Allowlist
) -> zmq.auth.thread.ThreadAuthenticator:
    """wire_security tag: no CURVE on `sock` (the messages carry tags, rpc/tag.py); a ZAP handler admits the
    peers whose address `accept_from` admits, so nobody else sends a byte. The caller stops the returned
    authenticator when it closes the socket."""
    auth = _ByAddress(sock.context, log=log)
    auth.accept_from = accept_from
    auth.start()
    sock.zap_domain = ZAP_DOMAIN.encode()
    return auth


class _ByAddress(zmq.auth.thread.ThreadAuthenticator):
    """A ZAP handler that admits a NULL-mechanism peer by its address alone (CIDRs, not only zmq.auth's exact
    addresses)."""

    accept_from: Allowlist
    refused = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:  # not a ZAP request: libzmq never sends one
            return
        version, request_id, _domain, address, _identity, mechanism = msg[:6]
        peer = address.decode("utf-8", "replace")
        if mechanism == b"NULL" and self.accept_from.admits_peer(peer):
            self.zap_socket.send_multipart([version, request_id, b"200", b"OK", b"anonymous", b""])
            return
        self.refused += 1
        log.warning(
            "refused a wire peer at %r (%s): accept_from %s does not admit it (%d refused so far)",
            peer, mechanism.decode("ascii", "replace"), list(self.accept_from.entries), self.refused,
        )  # fmt: skip
        self.zap_socket.send_multipart([version, request_id, b"400", b"Address not admitted", b"", b""])


class _OnlyKey:
    """zmq.auth's credentials provider: admits one client public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public
        self.refused = 0  # handshakes refused (a peer without the secret)

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        self.refused += 1
        log.warning(
            "refused a wire peer without the shared key (domain %s): %d refused so far", domain, self.refused
        )
        return False


def check_protected(
    endpoint: str, key: bytes | None, allow_unauthenticated: bool, log: logging.Logger
) -> (
    None
):  # wire_security tag has a key too: its peers are admitted by address (accept_from), its messages by tag
    """Protected mode: without a key, the connector binds only an endpoint of this host (loopback, ipc://), unless
    its config says `allow_unauthenticated` (then a WARNING says what that lets anyone do)."""
    if key is not None or host_only(endpoint):
        return
    if not allow_unauthenticated:
        raise ValueError(
            f"vitserve's connector will not bind {endpoint} without a key: set key_file in "
            "ec_connector_extra_config (the same file as vitserve --wire_key_file), or bind loopback "
            '(tcp://127.0.0.1:PORT) or ipc://, or set "allow_unauthenticated": true'
        )
    log.warning(
        "vitserve connector: %s is bound WITHOUT a key (allow_unauthenticated): anyone who reaches it can fill "
        "the bound and put tensors under any uuid; set key_file (vitserve --wire_key_file)",
        endpoint,
    )
