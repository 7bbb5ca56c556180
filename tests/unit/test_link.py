"""rpc/link.py: the words a sender's monitor events become. A v1 PULL receiver shows up one of two ways
(whichever end hangs up first, a race that load decides): both must name it."""

from __future__ import annotations

import errno

import pytest
import zmq

from vitserve.rpc.link import Link


@pytest.mark.parametrize(
    "last",
    [(zmq.EVENT_DISCONNECTED, 0), (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.ECONNRESET)],
    ids=["disconnected", "no-detail"],
)
def test_a_v1_receiver_is_named_however_the_handshake_ends(last):
    link = Link("ipc:///tmp/x.sock", keyed=False)
    link.on_event(zmq.EVENT_CONNECTED, 0)
    link.on_event(*last)
    assert not link.reachable
    assert "not a wire-v2 EmbeddingReceiver" in (link.refusal or "")


def test_a_precise_reason_is_not_replaced_by_a_vague_one():
    link = Link("ipc:///tmp/x.sock", keyed=False)
    link.on_event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    precise = link.refusal
    link.on_event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.EPIPE)
    assert link.refusal == precise
    assert "requires a key" in (precise or "")
    link.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    assert link.reachable
    assert link.refusal is None
