"""Pushing embeddings to the LLM server (docs/integration.md) from the engine, without blocking the event loop.

One sender thread owns the ordering: the engine awaits image k's push before it submits image k+1 of
the same request, and the single thread hands messages to ZMQ in submission order. A slow receiver
blocks the send (nothing is dropped); LLMSender raises Timeout past the request's deadline.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from vitserve.contract import EncodedImage, EncodeRequest
from vitserve.metrics import Metrics
from vitserve.rpc.sender import LLMSender


class LLMPush:
    def __init__(self, endpoint: str, metrics: Metrics):
        self._sender = LLMSender(endpoint)
        self.model = ""  # the served model's name, set once the ranks reported it
        self._metrics = metrics
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitserve-llm-send")
        self.sent = 0  # messages handed to ZMQ (the receiver must see exactly this many)

    async def push(self, *, request: EncodeRequest, image_index: int, encoded: EncodedImage) -> float:
        """Hand one image to ZMQ; returns the seconds it took. Raises Timeout past the deadline."""
        image = request.images[image_index]
        call = functools.partial(
            self._sender.send_embedding,
            request_id=request.request_id,
            image_index=image_index,
            num_images=len(request.images),
            image_id=image.image_id,
            model=self.model,
            grid_thw=tuple(image.item.grid_thw),
            embedding=encoded.embedding,
            deepstack=list(encoded.deepstack),
            deadline=request.deadline,
        )
        start = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(self._thread, call)
        seconds = time.monotonic() - start
        self.sent += 1
        nbytes = sum(t.numel() * t.element_size() for t in (encoded.embedding, *encoded.deepstack))
        self._metrics.embedding_bytes_sent_total.inc(nbytes)
        self._metrics.stage_seconds.labels(stage="send").observe(seconds)
        return seconds

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._sender.close()
