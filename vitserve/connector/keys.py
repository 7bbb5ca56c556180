"""The connector's side of the wire's shared secret (vitserve/rpc/wirekey.py derives both keypairs from it):
the connector's ROUTER is a CURVE server whose ZAP handler admits only the client public key derived from the
same secret, so a peer without it fails the handshake and nothing it sends is ever read."""

from __future__ import annotations

import logging

import zmq
import zmq.auth.thread

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
) -> None:
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
