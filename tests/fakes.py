"""Fakes that are real implementations of vitserve's interfaces, for tests where a real part cannot run."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from vitserve.errors import EncoderFailed, NotReady, QueueFull, Timeout
from vitserve.types import EncodedImage, ImageResult, ProcessedImage

# ------------------------------------------------------------------------------------------------------
# FakeEncoder: a deterministic Encoder with real computation and, at tp > 1, a real collective.
# ------------------------------------------------------------------------------------------------------

FAKE_PATCH_COLS = 3 * 2 * 14 * 14  # one Qwen2.5-VL patch row (C*T*P*P), so reservation's worst case fits
FAKE_MERGE = 4  # rows merged into one token, like the 2x2 spatial merge


def fake_weight(embed_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(FAKE_MERGE * FAKE_PATCH_COLS, embed_dim, generator=gen) / math.sqrt(FAKE_MERGE * FAKE_PATCH_COLS)


def fake_item(h_tokens: int, w_tokens: int, seed: int) -> ProcessedImage:
    """An image of h_tokens x w_tokens merged tokens, with seeded pixels."""
    gen = torch.Generator().manual_seed(seed)
    rows = FAKE_MERGE * h_tokens * w_tokens
    pixels = torch.randn(rows, FAKE_PATCH_COLS, generator=gen)  # (4 * tokens, C*T*P*P)
    return ProcessedImage(pixel_values=pixels, grid_thw=(1, 2 * h_tokens, 2 * w_tokens), num_tokens=h_tokens * w_tokens,
                          resized_size=(28 * w_tokens, 28 * h_tokens), clamped=False)


def fake_reference(item: ProcessedImage, embed_dim: int = 32, seed: int = 0) -> torch.Tensor:
    """What FakeEncoder computes for one image, in this process (for exactness checks)."""
    merged = item.pixel_values.reshape(-1, FAKE_MERGE * FAKE_PATCH_COLS)  # (tokens, 4 * cols)
    return merged @ fake_weight(embed_dim, seed)  # (tokens, dim)


def batch_hash(items) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(repr(tuple(it.grid_thw)).encode())
        h.update(it.pixel_values.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class _FakeVisual(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (4 * cols, dim / tp): this rank's columns
        # what reservation.worst_case_items reads for a Qwen-family tower
        self.config = SimpleNamespace(spatial_merge_size=2, patch_size=14, temporal_patch_size=2, in_channels=3)


class FakeEncoder:
    """embedding = (4 rows merged) @ W. At tp > 1 each rank owns dim/tp columns of W and the ranks
    all_gather their slices, so a rank that runs a different batch hangs or corrupts the result."""

    family = "qwen2_5_vl"
    model_name = "fake-encoder"
    num_deepstack = 0
    dtype = torch.float32
    device = torch.device("cpu")
    handles_tp = True  # shards itself; the worker must not run apply_tp on it

    def __init__(self, hooks: FakeEncoderFactory, rank: int, tp: int):
        if hooks.embed_dim % tp:
            raise ValueError(f"embed_dim {hooks.embed_dim} is not divisible by --tp {tp}")
        self.embed_dim, self.hooks, self.rank, self.tp = hooks.embed_dim, hooks, rank, tp
        cols = hooks.embed_dim // tp
        self.visual = _FakeVisual(fake_weight(hooks.embed_dim, hooks.seed)[:, rank * cols:(rank + 1) * cols].clone())
        self.calls = 0

    def encode(self, items):
        self._hooks(items)
        self.calls += 1
        x = torch.cat([it.pixel_values for it in items])  # (sum rows, cols)
        local = x.reshape(-1, FAKE_MERGE * FAKE_PATCH_COLS) @ self.visual.weight  # (sum tokens, dim / tp)
        if self.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local)
            local = torch.cat(parts, dim=1)  # (sum tokens, dim)
        out = torch.split(local, [it.num_tokens for it in items])
        return [EncodedImage(embedding=e.contiguous()) for e in out]

    def _hooks(self, items) -> None:
        h = self.hooks
        if self.calls < h.hooks_after_calls:  # the reservation stress ends at call 0
            return
        if h.hash_log_dir:
            with open(os.path.join(h.hash_log_dir, f"rank{self.rank}-pid{os.getpid()}.log"), "a") as f:
                f.write(batch_hash(items) + "\n")
        if h.raise_on_rank == self.rank and self.calls >= h.raise_on_call:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if h.sleep_s:
            time.sleep(h.sleep_s)


@dataclass(frozen=True)
class FakeEncoderFactory:
    """A picklable encoder_factory: the engine sends it to every spawned rank, which calls it with the config."""

    embed_dim: int = 32
    seed: int = 0
    sleep_s: float = 0.0  # per forward, after the reservation
    raise_on_rank: int | None = None  # this rank's forward raises ...
    raise_on_call: int = 1  # ... from this encode() call on (calls <= 0 are the reservation stress)
    hash_log_dir: str | None = None  # each rank appends a hash of every batch it ran
    hooks_after_calls: int = 1

    def __call__(self, config) -> FakeEncoder:
        rank = dist.get_rank() if dist.is_initialized() else 0
        enc = FakeEncoder(self, rank, config.tp)
        if config.visual_reserved_mem_gb is None:
            # The stress runs several batches (reservation.stress_batches); number the calls so that its last
            # one is call 0 and the first runtime batch call 1, whatever that count is.
            from vitserve.reservation import stress_batches

            enc.calls = 1 - sum(1 for _ in stress_batches(enc, config.visual_batch_max_tokens,
                                                          config.visual_infer_batch_size))
        return enc

# ---------------------------------------------------------------------------------------------------------
# FakeEngine: a tiny deterministic Encoder and an in-process Engine with the exact Engine contract
# (queue limit, FIFO token budget, deadlines, cancellation, drain), so the HTTP layer can be tested through a
# real uvicorn server where the multi-process Engine is not wanted (e.g. to hold the queue still).
# ---------------------------------------------------------------------------------------------------------

class TinyEncoder:
    """Encoder protocol: each 2x2 merge unit (4 consecutive patch rows, Qwen order) -> one seeded linear.

    Per-image independent by construction, so a packed batch gives exactly what one image alone gives.
    """

    family = "qwen2_5_vl"
    model_name = "tiny-fake-encoder"
    num_deepstack = 0
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, patch_dim: int = 3 * 2 * 14 * 14, embed_dim: int = 16, seed: int = 0):
        torch.manual_seed(seed)
        self.embed_dim = embed_dim
        self.visual = nn.Linear(4 * patch_dim, embed_dim)

    @torch.no_grad()
    def encode(self, items):
        rows = [it.pixel_values.reshape(-1, 4 * it.pixel_values.shape[1]) for it in items]  # (tokens, 4*D) each
        out = self.visual(torch.cat(rows).float())  # (sum tokens, embed_dim)
        return [EncodedImage(embedding=e.clone()) for e in out.split([r.shape[0] for r in rows])]


@dataclass
class _FakeRequest:
    request_id: str
    items: list
    image_ids: list
    deadline: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    return_embeddings: bool
    enqueued: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)
    cancelled: bool = False


class FakeEngine:
    """In-process Engine (the vitserve.types.EncodeEngine contract); one worker thread runs the encoder on FIFO batches.

    `gate` (threading.Event, set by default) holds the worker before each batch while cleared, so tests
    can let a queue build up.  `encoded_ids` records every image id that reached the encoder.
    """

    def __init__(self, config, metrics, *, encoder=None):
        self.config = config
        self.metrics = metrics
        self.encoder = encoder or TinyEncoder()
        self.gate = threading.Event()
        self.gate.set()
        self.encoded_ids: list[str] = []
        self._queue: deque = deque()  # of (request, index)
        self._cv = threading.Condition()
        self._ready = False
        self._stopping = False
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self.failed = asyncio.Event()  # set by tests to play "every encoder group is dead"

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()
        self._ready = True

    async def shutdown(self) -> None:
        self._ready = False
        self._stopping = True
        while self._in_flight:
            await asyncio.sleep(0.02)
        with self._cv:
            self._cv.notify_all()
        self.gate.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)

    def readiness(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        return (True, "ready") if self._ready else (False, "starting")

    def info(self) -> dict:
        enc = self.encoder
        return {"model": enc.model_name, "family": enc.family, "embed_dim": enc.embed_dim, "dtype": "float32",
                "tp": 1, "dp": 1, "reserved_memory_bytes": {0: 0}, "reserved_source": "override"}

    @property
    def queue_tokens(self) -> int:
        with self._cv:
            return sum(r.items[i].num_tokens for r, i in self._queue if not r.cancelled)

    @property
    def queue_images(self) -> int:
        with self._cv:
            return sum(1 for r, _ in self._queue if not r.cancelled)

    # -- the API's call ----------------------------------------------------------------------------------
    async def encode(self, request_id, items, image_ids, *, deadline, return_embeddings):
        if not self._ready:
            raise NotReady("engine is not ready")
        loop = asyncio.get_running_loop()
        req = _FakeRequest(request_id, list(items), list(image_ids), deadline, loop.create_future(), loop,
                           return_embeddings)
        new_tokens = sum(it.num_tokens for it in items)
        limit = self.config.queue_token_limit
        with self._cv:
            queued = sum(r.items[i].num_tokens for r, i in self._queue if not r.cancelled)
            if limit is not None and queued > 0 and queued + new_tokens > limit:
                raise QueueFull(f"{queued} tokens queued; limit {limit} (--max_queue_tokens)", retry_after_s=1.0)
            self._queue.extend((req, i) for i in range(len(items)))
            self._cv.notify()
        self._in_flight += 1
        try:
            return await asyncio.wait_for(asyncio.shield(req.future), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            self._withdraw(req)
            raise Timeout("deadline passed (--request_timeout_s)") from None
        except asyncio.CancelledError:  # the client went away: its queued items are never encoded
            self._withdraw(req)
            raise
        finally:
            self._in_flight -= 1

    def _withdraw(self, req) -> None:
        with self._cv:
            req.cancelled = True
            self._queue = deque(e for e in self._queue if e[0] is not req)

    # -- worker thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            self.gate.wait()  # tests clear the gate to let a queue build up
            batch = self._next_batch()
            if batch:
                self._forward(batch)

    def _wait_for_work(self) -> bool:
        with self._cv:
            while not self._queue:
                if self._stopping:
                    return False
                self._cv.wait(0.05)
            return True

    def _next_batch(self):
        budget = self.config.visual_batch_max_tokens
        with self._cv:
            batch, tokens = [], 0
            while self._queue and len(batch) < self.config.visual_infer_batch_size:
                req, i = self._queue[0]
                if req.cancelled or req.future.done():
                    self._queue.popleft()
                    continue
                if time.monotonic() > req.deadline:
                    self._queue.popleft()
                    self._fail(req, Timeout("deadline passed while queued (--request_timeout_s)"))
                    continue
                t = req.items[i].num_tokens
                if batch and budget and tokens + t > budget:
                    break
                batch.append(self._queue.popleft())
                tokens += t
            return batch

    def _forward(self, batch) -> None:
        start = time.monotonic()
        try:
            outs = self.encoder.encode([req.items[i] for req, i in batch])
        except Exception as exc:
            for req, _ in batch:
                self._fail(req, EncoderFailed(f"the encoder failed: {type(exc).__name__}"))
            return
        encode_ms = (time.monotonic() - start) * 1000
        for (req, i), out in zip(batch, outs, strict=True):
            self.encoded_ids.append(req.image_ids[i])
            req.results[i] = ImageResult(
                num_tokens=req.items[i].num_tokens,
                embedding=out.embedding if req.return_embeddings else None,
                deepstack=list(out.deepstack) if req.return_embeddings else [],
                timing_ms={"queue": (start - req.enqueued) * 1000, "encode": encode_ms, "send": 0.0},
            )
            if len(req.results) == len(req.items):
                done = [req.results[k] for k in range(len(req.items))]
                req.loop.call_soon_threadsafe(_settle, req.future, done, None)

    @staticmethod
    def _fail(req, err) -> None:
        req.loop.call_soon_threadsafe(_settle, req.future, None, err)


def _settle(future: asyncio.Future, result, err) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)
