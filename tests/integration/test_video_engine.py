"""A video's temporal groups through the real Engine (dispatcher, scheduler, JobTable, the real rank loop in a
thread): they enter the queue as a stream, one batch's worth at a time, so an image that arrives behind a long
video is encoded after about one batch, and the video's results come back in time order (docs/video.md)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import torch

from tests.fakes import TinyEncoder, thread_engine
from tests.integration.engine_helpers import deadline, make_config
from vitserve.contract import EncodeRequest, PreparedImage, PreparedVideo, ProcessedImage
from vitserve.metrics import Metrics

PATCH_DIM = 3 * 2 * 14 * 14


class RecordingEncoder(TinyEncoder):
    """TinyEncoder that records each batch as the labels its items carry in their first pixel value."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[int]] = []

    def encode(self, items):
        self.batches.append([int(it.pixel_values[0, 0]) for it in items])
        return super().encode(items)


def item(label: int, tokens: int) -> PreparedImage:
    pixels = torch.full((4 * tokens, PATCH_DIM), float(label))  # 4 patch rows per merged token
    processed = ProcessedImage(pixels, (1, 2, 2 * tokens), tokens, (28, 28 * tokens), False)
    return PreparedImage(processed, hashlib.sha256(f"item {label}".encode()).hexdigest(), (28, 28), 0.0, 0.0)


def video(labels: range, tokens: int) -> PreparedVideo:
    groups = tuple(item(label, tokens) for label in labels)
    times = tuple((g * 0.5, g * 0.5 + 0.25) for g in range(len(groups)))
    return PreparedVideo(groups, "ab" * 32, {"num_tokens": tokens * len(groups)}, times, 0.0, 0.0)


async def test_an_image_behind_a_long_video_waits_about_one_batch(tmp_path):
    config = make_config(tmp_path, visual_batch_max_tokens=64, visual_infer_batch_size=8)
    gate, encoder = threading.Event(), RecordingEncoder()
    engine = thread_engine(config, Metrics(), gate=gate, encoder=encoder)
    await engine.start()
    try:
        gate.clear()  # hold the encoder: the first batch stays in flight while the queue builds up
        long_video = video(range(100, 108), tokens=32)  # 8 groups, 2 per batch
        video_task = asyncio.create_task(
            engine.encode(EncodeRequest("v", (), deadline(), True, videos=(long_video,)))
        )
        await asyncio.sleep(0.2)
        # groups 0-1 are in flight, 2-3 are queued, 4-7 wait beside the queue (and count as queued)
        assert (engine.queue_images, engine.queue_tokens) == (6, 6 * 32)
        image_task = asyncio.create_task(engine.encode(EncodeRequest("i", (item(1, 16),), deadline(), True)))
        await asyncio.sleep(0.2)
        gate.set()
        video_results, image_results = await asyncio.gather(video_task, image_task)
    finally:
        gate.set()
        await engine.shutdown()
    # without the stream the image would go last, after all four batches of the video (no warm-up here)
    assert encoder.batches == [[100, 101], [102, 103], [1, 104], [105, 106], [107]]
    assert [r.num_tokens for r in video_results] == [32] * 8
    alone = TinyEncoder().encode([g.item for g in long_video.groups])
    for got, want in zip(video_results, alone, strict=True):  # each group's rows, in time order
        assert torch.equal(got.embedding, want.embedding)
    assert image_results[0].num_tokens == 16
