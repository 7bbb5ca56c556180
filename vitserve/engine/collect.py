"""Awaiting a request's Claims in item order and handing each to the LLM push: the engine's send order.

collect walks EncodeRequest.items (images, then each video's temporal groups in time order) with one Claim per
item still to hand over. Item k goes to --llm_endpoint only after the items before it were acknowledged, and
its ItemResult is built here; an item handed over already gets None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from vitserve.contract import EncodedImage, EncodeRequest, ItemResult, StageTimes
from vitserve.engine.jobs import Claim
from vitserve.engine.push import LLMPush
from vitserve.errors import Timeout
from vitserve.metrics import Metrics


async def collect(
    request: EncodeRequest,
    claims: list[Claim],
    push: LLMPush | None,
    metrics: Metrics,
    release: Callable[[Claim], None] | None = None,
) -> list[ItemResult | None]:
    """Await each claim in item order and push it to the LLM before the next (the send order). ``claims``:
    one per item not handed over, in `request.items` order.
    ``release``: called with each claim once its result is built, so the encoded output it holds is kept no
    longer than the answer needs it (without return_embeddings: not at all; a long video's groups would
    otherwise hold every group's embedding until the last one is encoded)."""
    results: list[ItemResult | None] = []
    pending = iter(claims)
    for item in request.items:
        if item.handed_over:
            results.append(None)
            continue
        claim = next(pending)
        encoded = claim.cached
        if encoded is None:
            assert claim.job is not None
            # shielded: this request leaving must not cancel an encode that other requests share
            encoded = await _wait(asyncio.shield(claim.job.future), request.deadline, request.request_id)
        send_s = 0.0
        if push is not None:  # this item goes out only after the ones before it were handed over
            send_s = await push.push(request=request, item=item, encoded=encoded)
        if claim.reused:  # a cache hit, or another request's encode of the same image or group
            metrics.images_total.labels(outcome="cached").inc()
        delivered = push is not None  # push() returned: the receiver acknowledged it
        results.append(_result(claim, encoded, send_s, request.return_embeddings, delivered))
        del encoded
        if release is not None:
            release(claim)
    return results


def _result(
    claim: Claim, encoded: EncodedImage, send_s: float, return_embeddings: bool, delivered: bool
) -> ItemResult:
    queue_s, encode_s = claim.timing
    return ItemResult(
        num_tokens=claim.prepared.item.num_tokens,
        embedding=encoded.embedding if return_embeddings else None,
        deepstack=tuple(encoded.deepstack) if return_embeddings else (),
        cached=claim.reused,
        delivered=delivered,
        timing=StageTimes(queue_ms=queue_s * 1e3, encode_ms=encode_s * 1e3, send_ms=send_s * 1e3),
    )


async def _wait(future: asyncio.Future[EncodedImage], deadline: float, request_id: str) -> EncodedImage:
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        return await asyncio.wait_for(future, remaining)
    except TimeoutError:
        raise Timeout(
            f"request {request_id} did not finish within its deadline (--request_timeout_s)"
        ) from None
