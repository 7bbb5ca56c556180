"""Fakes that are real implementations of vitserve's interfaces, for tests where a real part cannot run."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.distributed as dist
import zmq
from torch import nn

from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.engine import Engine
from vitserve.engine.groups import WorkerGroup
from vitserve.worker import messages as m
from vitserve.worker.args import WorkerArgs
from vitserve.worker.rank import RankWorker
from vitserve.worker.reservation.meter import Meter
from vitserve.worker.reservation.worst_case import qwen_item

# ------------------------------------------------------------------------------------------------------
# FakeEncoder: a deterministic Encoder with real computation and, at tp > 1, a real collective.
# ------------------------------------------------------------------------------------------------------

FAKE_PATCH_COLS = 3 * 2 * 14 * 14  # one Qwen2.5-VL patch row (C*T*P*P), so reservation's worst case fits
FAKE_MERGE = 4  # rows merged into one token, like the 2x2 spatial merge
# The vision config fake_item's pixels follow: FAKE_MERGE = merge^2 rows of FAKE_PATCH_COLS = C*T*P*P each
FAKE_VISION = SimpleNamespace(spatial_merge_size=2, patch_size=14, temporal_patch_size=2, in_channels=3)


def fake_weight(embed_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(FAKE_MERGE * FAKE_PATCH_COLS, embed_dim, generator=gen) / math.sqrt(
        FAKE_MERGE * FAKE_PATCH_COLS
    )


def fake_item(h_tokens: int, w_tokens: int, seed: int) -> ProcessedImage:
    """An image of h_tokens x w_tokens merged tokens, with seeded pixels: a Qwen2.5-VL-shaped item as the
    reservation's stress batches make them."""
    return qwen_item(FAKE_VISION, (h_tokens, w_tokens), seed)


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
        # what worker/reservation/worst_case.worst_case_items reads for a Qwen-family tower
        self.config = SimpleNamespace(
            spatial_merge_size=2, patch_size=14, temporal_patch_size=2, in_channels=3
        )


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
        self.weights_digest = f"fake-encoder:{hooks.seed}:{hooks.embed_dim}"  # what W is drawn from
        cols = hooks.embed_dim // tp
        self.visual = _FakeVisual(
            fake_weight(hooks.embed_dim, hooks.seed)[:, rank * cols : (rank + 1) * cols].clone()
        )
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
            # The stress runs several batches (worker/reservation/worst_case.stress_batches); number the calls so that its last
            # one is call 0 and the first runtime batch call 1, whatever that count is.
            from vitserve.worker.reservation.worst_case import stress_batches

            enc.calls = 1 - sum(
                1 for _ in stress_batches(enc, config.visual_batch_max_tokens, config.visual_infer_batch_size)
            )
        return enc


# ---------------------------------------------------------------------------------------------------------
# ThreadGroup: the real Engine over an in-process encoder group, so the HTTP layer can be tested through a
# real uvicorn server with the real queue, dedup, cache and push, while a test holds the encoder still.
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
        self.weights_digest = f"tiny-fake-encoder:{seed}:{patch_dim}:{embed_dim}"
        self.visual = nn.Linear(4 * patch_dim, embed_dim)

    @torch.no_grad()
    def encode(self, items):
        rows = [
            it.pixel_values.reshape(-1, 4 * it.pixel_values.shape[1]) for it in items
        ]  # (tokens, 4*D) each
        out = self.visual(torch.cat(rows).float())  # (sum tokens, embed_dim)
        return [EncodedImage(embedding=e.clone()) for e in out.split([r.shape[0] for r in rows])]


class HeldEncoder:
    """An encoder whose forward waits while `gate` is clear, and fails once `killed` is set (the group is
    gone while the batch was held). Everything else is the wrapped encoder's."""

    def __init__(self, encoder, gate: threading.Event, killed: threading.Event):
        self._encoder, self._gate, self._killed = encoder, gate, killed

    def __getattr__(self, name: str):
        return getattr(self._encoder, name)

    def encode(self, items):
        while not self._gate.wait(0.05):
            if self._killed.is_set():
                raise RuntimeError("the group was killed while its batch was held")
        return self._encoder.encode(items)


class ThreadGroup(WorkerGroup):
    """A WorkerGroup whose one rank is the real rank (vitserve/worker/rank.py RankWorker) in a thread of this
    process instead of a spawned process.

    Everything between the engine and the encoder is the production path: the group's state machine and batch
    socket, the typed messages, the rank's start-up steps, its loop (poll, forward, reply), its liveness thread
    (ALIVE while a forward is held) and its exit paths. Only the process-facing methods differ (spawn, kill,
    join, pids, _exited), and the rank runs as a thread of a test can: on the CPU (the fake encoders are CPU
    modules), with --visual_reserved_mem_gb (or 0) as its reservation instead of the stress, published in the
    engine's private runtime dir, with no parent to watch. `gate` (threading.Event, set by default) holds the
    encoder at the start of each forward while cleared, so tests can let a queue build up.
    """

    def __init__(self, *args, gate: threading.Event, ipc_dir: str, **kwargs):
        super().__init__(*args, ipc_dir=ipc_dir, **kwargs)
        if self.config.tp != 1:
            raise ValueError("a ThreadGroup is one rank: --tp 1")
        self.gate = gate
        self._ipc_dir = ipc_dir
        self._killed = threading.Event()
        self._thread: threading.Thread | None = None
        self._code: int | None = None  # what serve() returned, once the rank ended

    def worker_args(self, rank: int) -> WorkerArgs:
        config = replace(
            self.config,
            device="cpu",
            visual_reserved_mem_gb=self.config.visual_reserved_mem_gb or 0.0,
            runtime_dir=self._ipc_dir,
        )
        held = functools.partial(_held_encoder, self._factory, self.gate, self._killed)
        return replace(super().worker_args(rank), config=config, encoder_factory=held, parent_pid=None)

    # -- the process-facing methods of WorkerGroup ----------------------------------------------------------
    def spawn(self) -> None:
        args = self.worker_args(0)
        self._thread = threading.Thread(target=self._run, args=(args,), name=f"vitserve-g{self.index}r0")
        self._thread.daemon = True
        self._thread.start()

    def _run(self, args: WorkerArgs) -> None:
        worker = RankWorker(args)  # made here: its zmq sockets belong to this thread
        code = 1
        try:
            code = worker.serve()
        finally:
            self._code = code
            worker.close(code)

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def kill(self, grace_s: float = 0.0) -> None:
        """What SIGKILL is to a rank process: a STOP ends its loop now, a held forward fails."""
        self._killed.set()
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(zmq.Again):
                self._sock.send_multipart(m.encode(m.StopMsg()), flags=zmq.NOBLOCK)
            self._thread.join(5)
        self._sock.close(linger=0)

    def join(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or (not self._thread.is_alive() and self._code == 0)

    def _exited(self) -> str | None:
        if self._thread is not None and not self._thread.is_alive():
            return f"rank 0 (a thread) of group {self.index} exited with code {self._code}"
        return None


def _held_encoder(factory, gate: threading.Event, killed: threading.Event, config) -> HeldEncoder:
    return HeldEncoder(factory(config), gate, killed)


def thread_engine(config, metrics, *, gate: threading.Event, encoder=None) -> Engine:
    """The real Engine over ThreadGroups running `encoder` (default TinyEncoder)."""
    encoder = encoder or TinyEncoder()
    return Engine(
        config,
        metrics,
        encoder_factory=lambda _config: encoder,
        environ={},
        group_factory=functools.partial(ThreadGroup, gate=gate),
    )


class InflatedMeter(Meter):
    """A real meter (vitserve/worker/reservation/meter.py) that publishes at least `reads_at_least` bytes: a run
    over --visual_mem_gb's target, injected where a real one cannot be forced (the tests of
    vitserve/worker/reservation/sizing.py's shrink). Same interface; the run itself is real."""

    def __init__(self, inner: Meter, reads_at_least: int):
        self.inner, self.reads_at_least = inner, reads_at_least
        self.baseline, self.factor = inner.baseline, inner.factor

    def measure(self, run: Callable[[], None]) -> int:
        return max(self.inner.measure(run), math.ceil(self.reads_at_least / self.factor))

    def hold(self, nbytes: int) -> int:
        return self.inner.hold(nbytes)

    def report(self) -> None:
        self.inner.report()
