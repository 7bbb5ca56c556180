"""One message on its way to a receiver, and the one loop that awaits a request's messages (docs/wire.md).

LLMSender (rpc/sender.py) sends, resends on a reconnect and fails at the deadline on its own I/O thread; it
settles each message's `Delivery.acked`. `settle` is how both pushes await them from asyncio: the `/encode`
push to an `--llm_endpoint` receiver (engine/push.py, one item at a time, in order) and the wire transport's
push to vitserve's vLLM connector (handover/wire.py, a request's items at once). It awaits the deliveries in
order, counts each one's outcome once in `vitserve_llm_messages_total{outcome}` (`delivered`, `withdrawn`, or
the code of the error that ended it: `llm_timeout`, `llm_refused`, `not_ready`), and withdraws the rest when one
fails or the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from vitserve.errors import LLMTimeout, VitserveError

EXPIRY_MARGIN_S = 0.25  # a message expires this long before its request's deadline (docs/wire.md)


class WireRefused(VitserveError):
    """The receiver refused a message (a nack) and keeps nothing of it; its reason is in the message."""

    status, code = 502, "llm_refused"


class Unsent(LLMTimeout):
    """The deadline passed before the message could be handed to a receiver: none was connected (or it was
    full) all along. Still `llm_timeout` to a client; a transport that needs a receiver says so instead."""


@dataclass(eq=False)
class Delivery:
    """One message on its way. `acked` resolves when the receiver acknowledged it, or raises LLMTimeout
    (deadline passed; Unsent when it never left), WireRefused (a nack) or NotReady (sender closed); cancelling
    it withdraws the message."""

    message_id: str
    frames: list[bytes | memoryview]
    deadline: float  # time.monotonic() based
    nbytes: int
    acked: Future[None] = field(default_factory=Future)
    sent_at: float | None = None  # monotonic time ZMQ took it (last time, when sent again)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until acknowledged; raises as `acked` does (or TimeoutError after timeout_s)."""
        self.acked.result(timeout_s)


def expires_at(deadline: float) -> float:
    """The Unix time a message for a request with this (monotonic) deadline expires: shortly before the
    deadline, so an acknowledgement sent just before expiry still reaches the sender in time."""
    remaining = deadline - time.monotonic()
    return time.time() + remaining - min(EXPIRY_MARGIN_S, max(remaining, 0.0) / 2)


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Outcomes(Protocol):
    """A counter by outcome: prometheus_client's Counter with the label `outcome`."""

    def labels(self, *, outcome: str) -> _Counter: ...


async def settle(deliveries: Sequence[Delivery], outcomes: Outcomes) -> None:
    """Return once every delivery was acknowledged, in order; else raise the first one's error (the rest are
    withdrawn). Each outcome is counted once; cancelling this withdraws whatever is not acknowledged yet."""
    try:
        for d in deliveries:
            await _acknowledged(d, outcomes)
    finally:
        for d in deliveries:
            d.acked.cancel()  # a no-op on what was acknowledged; the sender forgets the rest


async def _acknowledged(d: Delivery, outcomes: Outcomes) -> None:
    try:
        await asyncio.wrap_future(d.acked)
    except VitserveError as exc:
        outcomes.labels(outcome=exc.code).inc()
        raise
    except asyncio.CancelledError:  # the client went away: the message is withdrawn if still unsent
        outcomes.labels(outcome="withdrawn").inc()
        raise
    outcomes.labels(outcome="delivered").inc()
