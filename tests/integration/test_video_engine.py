"""A video's temporal groups through the real Engine (dispatcher, scheduler, JobTable, the real rank loop in a
thread): they enter the queue as a stream, one batch's worth at a time, so an image that arrives behind a long
video is encoded after about one batch, and the video's results come back in time order (docs/video.md)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import replace

import torch

from tests.fakes import TinyEncoder, thread_engine
from tests.integration.engine_helpers import deadline, make_config
from tests.videos import video_metadata
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
    return PreparedVideo(groups, video_metadata((len(groups), 2, 2 * tokens), "ab" * 32), times, 0.0, 0.0)


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
        assert (engine.queue_items, engine.queue_tokens) == (6, 6 * 32)
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


class LabelFeed:
    """A GroupFeed whose group g's pixels are item(100 + g)'s: records each chunk asked for and how many of
    the video's groups held pixels at that moment."""

    def __init__(self, groups: tuple[PreparedImage, ...], chunk_groups: int) -> None:
        self.groups, self.chunk_groups = groups, chunk_groups
        self.calls: list[list[int]] = []
        self.holding: list[int] = []

    async def pixels(self, groups: list[int]) -> list[torch.Tensor]:
        self.calls.append(groups)
        self.holding.append(sum(g.item.pixel_values.numel() > 0 for g in self.groups))
        return [item(100 + g, 32).item.pixel_values for g in groups]

    def times(self) -> tuple[float, float]:
        return 0.0, 0.0


async def test_a_fed_video_makes_its_pixels_a_chunk_at_a_time_and_drops_them(tmp_path):
    """A video from the API comes without pixels (engine/feed.py): with the encoder stalled, only the chunk in
    flight, the one queued and the next are made (3 of 4); every group's pixels are gone once it is encoded;
    the results equal the same groups encoded with their pixels given up front."""
    config = make_config(tmp_path, visual_batch_max_tokens=64, visual_infer_batch_size=8)
    gate, encoder = threading.Event(), RecordingEncoder()
    engine = thread_engine(config, Metrics(), gate=gate, encoder=encoder)
    await engine.start()
    full = video(range(100, 108), tokens=32)
    empty = tuple(  # the same groups, their pixels left to the feed (other ids: nothing shared with `full`)
        PreparedImage(replace(g.item, pixel_values=torch.empty(0)), hashlib.sha256(g.image_id.encode()).hexdigest(),
                      g.original_size, 0.0, 0.0)
        for g in full.groups
    )  # fmt: skip
    feed = LabelFeed(empty, chunk_groups=2)
    fed = PreparedVideo(
        empty, video_metadata((len(empty), 2, 64), "cd" * 32), full.group_times, 0.0, 0.0, feed
    )
    try:
        gate.clear()
        task = asyncio.create_task(engine.encode(EncodeRequest("v", (), deadline(), True, videos=(fed,))))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(feed.calls) == 3:
                break
        await asyncio.sleep(0.2)
        assert feed.calls == [[0, 1], [2, 3], [4, 5]]  # chunk 0 in flight, 1 queued, 2 made: 3 of 4
        gate.set()
        results = await task
    finally:
        gate.set()
        await engine.shutdown()
    assert feed.calls == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (
        max(feed.holding) <= 4
    )  # asked while two chunks hold pixels (in flight, queued), whatever the length
    assert all(g.item.pixel_values.numel() == 0 for g in empty)  # dropped once encoded
    assert [b for batch in encoder.batches for b in batch] == list(range(100, 108))
    alone = TinyEncoder().encode([g.item for g in full.groups])
    for got, want in zip(results, alone, strict=True):
        assert torch.equal(got.embedding, want.embedding)
