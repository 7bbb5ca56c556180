"""rpc/delivery.py's settle: the one loop both pushes await (the /encode push and the wire transport's), each
outcome counted once, by the code a client sees, and the rest withdrawn when one fails."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from vitserve.errors import NotReady
from vitserve.rpc.delivery import Delivery, Unsent, WireRefused, settle


def outcomes() -> Counter:
    return Counter("messages", "by outcome", ["outcome"], registry=CollectorRegistry())


def count(counter: Counter, outcome: str) -> float:
    return counter.labels(outcome=outcome)._value.get()


def delivery(name: str) -> Delivery:
    return Delivery(name, [b"x"], deadline=0.0, nbytes=1)


def test_every_acknowledged_delivery_is_counted_once():
    async def main(ds: list[Delivery], c: Counter) -> None:
        loop = asyncio.get_running_loop()
        for d in ds:
            loop.call_later(0.01, d.acked.set_result, None)
        await settle(ds, c)

    c, ds = outcomes(), [delivery(str(i)) for i in range(3)]
    asyncio.run(main(ds, c))
    assert count(c, "delivered") == 3


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (WireRefused("full: no room"), "llm_refused"),
        (Unsent("none connected"), "llm_timeout"),
        (NotReady("bye"), "not_ready"),
    ],
)
def test_the_first_failure_is_raised_counted_by_its_code_and_the_rest_withdrawn(error, code):
    c, ds = outcomes(), [delivery(str(i)) for i in range(3)]
    ds[0].acked.set_result(None)
    ds[1].acked.set_exception(error)
    with pytest.raises(type(error)):
        asyncio.run(settle(ds, c))
    assert (count(c, "delivered"), count(c, code)) == (1, 1)
    assert ds[2].acked.cancelled(), "the sender forgets a cancelled delivery: it is not sent"


def test_a_caller_cancelled_withdraws_what_is_not_acknowledged():
    async def main(ds: list[Delivery], c: Counter) -> None:
        task = asyncio.create_task(settle(ds, c))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    c, ds = outcomes(), [delivery(str(i)) for i in range(2)]
    asyncio.run(main(ds, c))
    assert count(c, "withdrawn") == 1
    assert all(d.acked.cancelled() for d in ds)
