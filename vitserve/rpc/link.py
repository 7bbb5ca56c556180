"""What the sender's socket monitor says about its connection to the receiver (rpc/sender.py), in words a user
can act on: why a ZMTP handshake failed, so that /ready and the 502 of --llm_transport wire name a key that
differs instead of saying that nothing is connected.

What libzmq 4.3 reports on the connecting side (measured with vitserve's CURVE keys, rpc/wirekey.py):

| the two ends | event | value |
|---|---|---|
| the same secret | HANDSHAKE_SUCCEEDED | |
| different secrets | HANDSHAKE_FAILED_NO_DETAIL (the server cannot read our HELLO and hangs up) | EPIPE |
| one keyed, one keyless | HANDSHAKE_FAILED_PROTOCOL | PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH |
| a client key the server's ZAP handler refuses | HANDSHAKE_FAILED_AUTH | ZAP status code (400) |
| a peer that is not ZMQ (an HTTP server) | HANDSHAKE_FAILED_NO_DETAIL | ECONNRESET or EPIPE |
| a ZMQ socket of another type (a v1 PULL) | DISCONNECTED before HANDSHAKE_SUCCEEDED, or HANDSHAKE_FAILED_NO_DETAIL when the peer hangs up first | |

A keyed server may also hang up on a keyless client before the client reads why (NO_DETAIL instead of the
mechanism mismatch, about one try in three here): NO_DETAIL is the vague one, so it never replaces a precise
reason seen before.
"""

from __future__ import annotations

import logging
import threading

import zmq

log = logging.getLogger("vitserve.rpc.sender")  # the sender's own lines

EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
KEYS = "the connector's key_file and --wire_key_file"


def handshake_failure(event: int, value: int, *, keyed: bool, tagged: bool = False) -> str:
    """Why a handshake failed (`event` one of FAILURES, `value` the monitor's), for a sender with or without a
    key (--wire_key_file), keyed by CURVE or by a tag per message (--wire_security tag: no key in the handshake)."""
    if tagged:
        return _tagged_failure(event, value)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the connector refused this sender's key (status {value}): {KEYS} hold different secrets"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if keyed:
                return (
                    "the connector has no key_file, or its wire_security is tag, but --wire_key_file is set with "
                    "--wire_security curve: give both ends one key and one wire_security"
                )
            return "the connector requires a key: give --wire_key_file the file its key_file names"
        return f"the peer broke the ZMTP handshake (protocol error {value:#x}): not vitserve's connector"
    if keyed:
        return (
            f"the connector ended the key handshake: {KEYS} hold different secrets, or the connector's "
            "wire_security is tag (give both ends one wire_security)"
        )
    return (
        "the peer ended the ZMTP handshake: it wants a key (give --wire_key_file the file its key_file names), "
        "it is not a wire-v2 EmbeddingReceiver (a v1 PULL receiver?), or it does not speak ZMQ "
        "(is --llm_endpoint the connector's?)"
    )


def _tagged_failure(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the connector refused this host's address (status {value}): its wire_security tag admits the "
            "senders its accept_from lists"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "the connector keys its wire with CURVE (its wire_security is curve) and this sender has "
            "--wire_security tag: give both ends one wire_security"
        )
    return (
        "the peer ended the ZMTP handshake: it keys with CURVE (give both ends one wire_security), or it is not "
        "vitserve's connector (is --llm_endpoint the connector's?)"
    )


def wrong_socket_type() -> str:
    """A peer that dropped the connection during the handshake with no failure event: a ZMQ socket of another
    type (the handshake compares socket types)."""
    return (
        "the peer dropped the connection during the ZMTP handshake: it is not a wire-v2 EmbeddingReceiver "
        f"(a v1 PULL receiver?), or it wants another key ({KEYS} differ); see docs/wire.md"
    )


class Link:
    """The sender's connection as its monitor reports it (events read on the sender's I/O thread; the state is
    read from any thread): `reachable` while a handshake has succeeded and the connection stands, `refusal` the
    reason the last handshake failed until one succeeds. Reaching the receiver and losing it are logged once
    each, every reason once until a handshake succeeds."""

    def __init__(self, endpoint: str, *, keyed: bool, tagged: bool = False) -> None:
        self.endpoint = endpoint
        self.keyed, self.tagged = keyed, tagged
        self.reachable = False
        self.refusal: str | None = None
        self.connected = threading.Event()  # set while reachable (LLMSender.wait_reachable)
        self._handshaking = False  # connected, ZMTP handshake not done yet
        self._logged: str | None = None
        self._precise = False  # `refusal` came from a PROTOCOL or AUTH failure (module docstring)

    def on_event(self, event: int, value: int) -> bool | None:
        """Take one monitor event; True when the receiver was reached, False when the connection went."""
        if event == zmq.EVENT_CONNECTED:
            self._handshaking = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._reached()
            return True
        elif event == zmq.EVENT_DISCONNECTED:
            self._lost()
            return False
        elif event in FAILURES and not (event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._precise):
            self._precise = event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            self._refused(handshake_failure(event, value, keyed=self.keyed, tagged=self.tagged))
        return None

    def tag_refused(self, why: str) -> None:
        """A reply whose tag did not open (--wire_security tag): the connection stands, nothing it says is read."""
        self._refused(
            f"the connector's replies fail their tag ({why}); give the connector the key_file and wire_security "
            "tag that --wire_key_file and --wire_security name"
        )

    def _reached(self) -> None:
        if not self.reachable:
            log.info("reached the receiver at --llm_endpoint %s", self.endpoint)
        self.reachable, self._handshaking = True, False
        self.refusal = self._logged = None
        self._precise = False
        self.connected.set()

    def _lost(self) -> None:
        if self.reachable:
            log.warning("lost the receiver at --llm_endpoint %s; reconnecting", self.endpoint)
        self.reachable = False
        self.connected.clear()
        if self._handshaking and self.refusal is None:  # no failure event: a socket of another type
            self._refused(wrong_socket_type())
        self._handshaking = False

    def _refused(self, reason: str) -> None:
        self.refusal, self._handshaking = reason, False
        if reason != self._logged:  # libzmq retries every 100 ms
            self._logged = reason
            log.error("the receiver at --llm_endpoint %s: %s", self.endpoint, reason)
