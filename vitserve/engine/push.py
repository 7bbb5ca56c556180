"""Pushing embeddings to the LLM server (docs/wire.md) from the engine, without blocking the event loop.

push() sends one item (an image, or a video's temporal group) and returns once the receiver acknowledged
it: the engine awaits item k's push before it sends item k+1 of the same request, so a request's images and
then its videos' groups arrive in order (each group as soon as it is encoded and its predecessors were
delivered), and /encode can answer 200 only when every item was delivered. No acknowledgement by the request's
deadline raises LLMTimeout (504 llm_timeout). LLMSender's own I/O thread does the socket work, and
rpc/delivery.py's `settle` (the wire transport's too) awaits it and counts its outcome.
"""

from __future__ import annotations

import time

from vitserve.contract import EncodedImage, EncodeRequest, RequestItem
from vitserve.metrics import Metrics
from vitserve.rpc.delivery import settle
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding, VideoGroupRef


class LLMPush:
    def __init__(self, endpoint: str, metrics: Metrics):
        self._sender = LLMSender(endpoint)
        self.endpoint = endpoint
        self.model = ""  # the served model's name, set once the ranks reported it
        self._metrics = metrics
        self.sent = 0  # messages the receiver acknowledged in time

    @property
    def reachable(self) -> bool:
        """A ROUTER receiver is connected now (ZMTP handshake done, heartbeats answered)."""
        return self._sender.reachable

    async def push(self, *, request: EncodeRequest, item: RequestItem, encoded: EncodedImage) -> float:
        """Send one item of the request (EncodeRequest.items: its images, then every video's groups) and
        wait for its acknowledgement; returns the seconds that took. Raises LLMTimeout past the request's
        deadline (the message expires with it)."""
        assert item.prepared is not None, "an item handed over already is not sent again"
        start = time.monotonic()
        message = ImageEmbedding(
            request_id=request.request_id,
            image_index=item.index,  # the wire's names (docs/wire.md): an item's place, video groups included
            num_images=len(request.items),
            image_id=item.prepared.image_id,
            grid_thw=item.prepared.item.grid_thw,
            embedding=encoded.embedding,
            deepstack=list(encoded.deepstack),
            model=self.model,
            traceparent=request.traceparent,
            video=_video_ref(item),
        )
        delivery = self._sender.send(message, deadline=request.deadline)
        await settle([delivery], self._metrics.llm_messages_total)  # cancelling this withdraws the message
        seconds = time.monotonic() - start
        self.sent += 1
        self._metrics.embedding_bytes_sent_total.inc(delivery.nbytes)
        self._metrics.stage_seconds.labels(stage="send").observe(seconds)
        return seconds

    def close(self) -> None:
        self._sender.close()


def _video_ref(item: RequestItem) -> VideoGroupRef | None:
    """A video group's place on the wire (the header's `video` map); None for an image."""
    if item.group is None:
        return None
    return VideoGroupRef(
        item.media_index, item.video_id, item.group, item.num_groups, item.start_s, item.end_s
    )
