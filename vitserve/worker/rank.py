"""One encoder rank: a spawned process that starts up in named steps, then runs the rank loop.

Rank 0 of a group talks to the engine over ZMQ and is the only rank that decides; the other ranks run
exactly the steps rank 0 broadcasts (broadcast.py). Every rank reports liveness (liveness.py) and, on a
failure, reports an ERROR to the engine and exits, so the engine's watchdog can tear the group down.

A spawned rank is worker/process.py `run_worker`: it sets what belongs to the process, then runs
`RankWorker.serve()` and `exit`s with its code. The tests run the same `RankWorker` in a thread of the
engine's process (tests/fakes.py ThreadGroup): `serve()` returns the exit code, and `close` ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.errors import ConfigError, MemoryTargetError
from vitserve.model.base import Encoder
from vitserve.rpc.tensors import dtype_name
from vitserve.worker import broadcast
from vitserve.worker import messages as m
from vitserve.worker.args import WorkerArgs, on_cuda, startup_timeout_s
from vitserve.worker.liveness import LivenessThread, LoopCounters
from vitserve.worker.rendezvous import beat_for, open_store
from vitserve.worker.reservation import PeakWatch, Reservation, reserve_for_rank
from vitserve.worker.reservation.published import publish_reservation, remove_reservation
from vitserve.worker.slots import write_slot

log = logging.getLogger(__name__)


class RankFailed(Exception):
    """The rank cannot go on; the reason was already reported to the engine."""


class RankWorker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        self.cfg = args.config
        self.counters = LoopCounters()
        self.ctx = zmq.Context()
        self.status = self.ctx.socket(zmq.PUSH)
        self.status.setsockopt(zmq.LINGER, 2000)  # let a final ERROR/RESULT reach the engine before exit
        self.status.connect(args.status_endpoint)
        self.inbox: zmq.Socket[bytes] | None = None
        self.encoder: Encoder | None = None
        self.distributed = self.cfg.tp > 1
        self.reservation: Reservation | None = None  # once measured (or stored, or the override)
        self.peak_watch: PeakWatch | None = None  # with it, except for an override
        self.started = time.monotonic()

    def serve(self) -> int:
        """Start up, then run the loop until STOP; the exit code: 0 after STOP, 1 after a failure (reported)."""
        try:
            self.start_up()
        except BaseException as exc:  # report why start-up failed (the message names the knob)
            self.report_error("startup", exc)
            return 1
        try:
            self.run()
        except RankFailed:
            return 1
        return 0

    # ------------------------------------------------------------------------------------ start-up

    def start_up(self) -> None:
        self._init_liveness()
        self._init_device()
        self._init_process_group()
        self._init_encoder()
        self._init_reservation()
        self._init_inbox()
        self._send_ready()

    def _init_liveness(self) -> None:
        self.liveness = LivenessThread(
            self.ctx,
            self.args.status_endpoint,
            group=self.args.group,
            rank=self.args.rank,
            parent_pid=self.args.parent_pid,
            heartbeat_s=self.cfg.heartbeat_s,
            counters=self.counters,
        )
        self.liveness.start()

    def _init_device(self) -> None:
        if on_cuda(self.cfg):
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"--device {self.cfg.device} was requested but CUDA is not available; use --device cpu"
                )
            local = len(self.cfg.node_ranks)  # --tp / --nnodes ranks of each group on this node
            if self.distributed and torch.cuda.device_count() < local:  # NCCL: one rank per GPU
                raise ConfigError(
                    f"--tp {self.cfg.tp} over --nnodes {self.cfg.nnodes} on CUDA needs {local} GPUs per node, "
                    f"found {torch.cuda.device_count()}; lower --tp or add nodes"
                )
            # one rank per GPU when there are enough (--tp x --dp <= GPUs); else groups share round-robin
            index = self.args.local_index % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        elif self.cfg.cuda_graphs:  # --device auto found no GPU: refuse now, not after the stress
            raise ConfigError("--cuda_graphs needs a CUDA device and none is available; drop --cuda_graphs")
        else:
            self.device = torch.device("cpu")  # its share of the cores: run_worker
        # NCCL collectives need device tensors; gloo works on CPU tensors
        self.comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")

    def _init_process_group(self) -> None:
        if not self.distributed:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # Our own store: ranks may reach the rendezvous far apart (imports, weights) and that wait is bounded
        # by the start-up limit; --dist_timeout_s bounds each collective afterwards.
        rv, wait = self.args.rendezvous, timedelta(seconds=startup_timeout_s(self.cfg))
        if rv.file is not None:  # one host: keep gloo's / NCCL's own listening sockets on loopback too
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = "lo"
        elif self.cfg.nnodes > 1:
            whom = "node 0" if self.cfg.node_rank else f"the ranks of nodes 1..{self.cfg.nnodes - 1}"
            self._say(f"waiting for {whom} at {rv.where} (--nnodes {self.cfg.nnodes}, --tp {self.cfg.tp})")
        store = open_store(
            rv, world_size=self.cfg.tp, rank=self.args.rank, group=self.args.group, timeout=wait
        )
        dist.init_process_group(
            backend,
            store=store,
            world_size=self.cfg.tp,
            rank=self.args.rank,
            timeout=timedelta(seconds=self.cfg.dist_timeout_s),
        )
        beat = beat_for(
            rv,
            tp=self.cfg.tp,
            nnodes=self.cfg.nnodes,
            group=self.args.group,
            rank=self.args.rank,
            heartbeat_s=self.cfg.heartbeat_s,
        )
        self.liveness.node0, self.liveness.beat = rv.where, beat

    def _init_encoder(self) -> None:
        self._say(f"loading weights: --model {self.cfg.model} on {self.device}")
        start = time.monotonic()
        self.encoder = enc = self.args.encoder_factory(self.cfg)
        self._say(f"loading weights: done in {time.monotonic() - start:.1f} s")
        # Encoders that shard themselves (test fakes) say so; real towers get the TP pass.
        if self.distributed and not getattr(enc, "handles_tp", False):
            from vitserve.model.tp import apply_tp  # only needed for tp > 1

            apply_tp(enc.visual, enc.family)
        visual = getattr(enc, "visual", None)
        if isinstance(visual, torch.nn.Module):  # weights final: oneDNN's layout, before the baseline
            from vitserve.model.fast_linear import pack_linear_weights

            pack_linear_weights(visual)

    def _init_reservation(self) -> None:
        """The stored reservation when nothing changed since it was measured, else the stress; then publish."""
        assert self.encoder is not None
        res, self.peak_watch = reserve_for_rank(
            self.cfg,
            self.args.stress_shape,
            self.encoder,
            self.device,
            self.args.rank,
            self.args.global_rank,
            self._say,
        )
        if self.cfg.cuda_graphs:  # the graphs' pool joins the published bytes (worker/graphs.py)
            from vitserve.worker.graphs import capture_for_serving

            shape = dataclasses.replace(
                self.args.stress_shape,
                visual_batch_max_tokens=res.budget_tokens or self.cfg.visual_batch_max_tokens,
            )
            res = capture_for_serving(
                self.encoder, shape, res, self.peak_watch
            )  # at --visual_mem_gb's budget too
        self._say(f"publishing: {res.bytes / 2**20:.0f} MiB reserved ({res.method.value})")
        publish_reservation(
            self.cfg.runtime_dir, self.device.type, self.args.global_rank, res.bytes, res.source
        )
        self.reservation = res

    def _say(self, line: str) -> None:
        """A progress line on stderr whatever --log_level says (like the banner), from one rank per group and node."""
        if self.args.rank == self.cfg.node_ranks.start:  # rank 0, or the first rank of another node
            elapsed = time.monotonic() - self.started
            print(f"vitserve [group {self.args.group}] +{elapsed:.1f} s {line}", file=sys.stderr, flush=True)

    def _init_inbox(self) -> None:
        if self.args.rank != 0:
            return
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(self.args.batch_endpoint)  # bound before READY: the engine's queued batches flow in

    def _send_ready(self) -> None:
        enc, res = self.encoder, self.reservation
        assert enc is not None
        assert res is not None
        self.status.send_multipart(
            m.encode(
                m.ReadyMsg(
                    group=self.args.group,
                    rank=self.args.rank,
                    pid=os.getpid(),
                    model_name=enc.model_name,
                    family=enc.family,
                    embed_dim=enc.embed_dim,
                    num_deepstack=enc.num_deepstack,
                    dtype=dtype_name(enc.dtype),
                    device=str(self.device),
                    reserved_bytes=res.bytes,
                    reserved_source=res.source,
                    weights_digest=enc.weights_digest,
                    budget_tokens=res.budget_tokens
                    or self.cfg.visual_batch_max_tokens,  # --visual_mem_gb's choice
                    sizing=res.sizing,
                )
            )
        )

    # ------------------------------------------------------------------------------------ the loop

    def run(self) -> None:
        """poll -> broadcast -> forward -> reply, until STOP."""
        while True:
            kind, batch = self._exchange_step()  # 1) rank 0 polls the engine; peers hear rank 0
            if kind is m.Kind.STOP:
                return
            if kind is m.Kind.HEARTBEAT:
                self.counters.heartbeats += 1
                continue
            assert batch is not None
            started = time.perf_counter()
            outputs = self._forward(batch)  # 2) the same forward on every rank, on its shard
            self.counters.batches += 1
            if self.peak_watch is not None:
                self.peak_watch.check()  # a live peak above the reservation: warn, re-measure next start
            if self.args.rank == 0:
                self._reply(batch, outputs, started)  # 3) embeddings back to the engine
            # Drop this batch's frames before waiting for the next: otherwise two batches' pixels are live in
            # zmq's receive arena at once, and the runtime peak outgrows the reservation (docs/design.md invariant 7).
            del batch, outputs

    def _exchange_step(self) -> tuple[m.Kind, m.BatchMsg | None]:
        """_next_step, or report and exit when a peer is gone (its node died: gloo sees the socket close)."""
        try:
            return self._next_step()
        except Exception as exc:  # torch.distributed's errors name the peer and the cause
            self.report_error("broadcast", exc, trace=False)
            raise RankFailed from exc

    def _next_step(self) -> tuple[m.Kind, m.BatchMsg | None]:
        if self.args.rank != 0:
            return broadcast.recv_step(self.comm_device)
        kind, batch = self._poll_engine()
        if self.distributed:
            broadcast.send_step(kind, batch, self.comm_device)
        return kind, batch

    def _poll_engine(self) -> tuple[m.Kind, m.BatchMsg | None]:
        """The engine's next message, or a HEARTBEAT when none came within --heartbeat_s."""
        assert self.inbox is not None
        heartbeat_at = time.monotonic() + self.cfg.heartbeat_s
        while True:
            wait_ms = max(0, int((heartbeat_at - time.monotonic()) * 1000))
            if not self.inbox.poll(timeout=wait_ms):
                return m.Kind.HEARTBEAT, None
            frames = self.inbox.recv_multipart(copy=False)
            try:
                msg = m.decode([f.buffer for f in frames])
            except m.MessageError as exc:  # garbage on an internal socket: drop it, keep serving
                log.warning("dropped a malformed message on the batch socket: %s", exc)
                continue
            if isinstance(msg, m.BatchMsg):
                return m.Kind.BATCH, msg
            if isinstance(msg, m.StopMsg):
                return m.Kind.STOP, None
            log.warning("dropped an unexpected %s message on the batch socket", msg.kind.value)

    def _forward(self, batch: m.BatchMsg) -> list[EncodedImage]:
        try:
            assert self.encoder is not None
            with torch.inference_mode():
                items = [self._to_device(it) for it in batch.items]
                return self.encoder.encode(items)
        except BaseException as exc:  # this rank cannot go on: report, exit; the engine kills the group
            self.report_error("forward", exc, batch.batch_id)
            raise RankFailed from exc

    def _to_device(self, item: ProcessedImage) -> ProcessedImage:
        if self.device.type == "cpu":
            return item
        item.pixel_values = item.pixel_values.to(self.device, non_blocking=True)
        return item

    def _reply(self, batch: m.BatchMsg, outputs: list[EncodedImage], started: float) -> None:
        """The embeddings to the engine, with the forward's seconds since `started` (the copy to the host
        included: on a GPU it waits for the forward's kernels): into the result slot the engine lent, else
        as frames (worker/slots.py)."""
        cpu = [
            type(o)(embedding=o.embedding.cpu(), deepstack=[d.cpu() for d in o.deepstack]) for o in outputs
        ]
        forward_s = time.perf_counter() - started
        result = m.ResultMsg(group=self.args.group, batch_id=batch.batch_id, outputs=cpu, forward_s=forward_s)
        frames = m.encode(result)
        spans = write_slot(batch.slot, frames[1:]) if batch.slot else None
        if spans is not None:
            frames = m.in_slot(frames, batch.slot, spans)
        self.status.send_multipart(frames, copy=False)

    # ------------------------------------------------------------------------------------ exit paths

    def report_error(self, stage: str, exc: BaseException, batch_id: int = -1, *, trace: bool = True) -> None:
        """Log and send the error; trace=False for an expected end (a peer's node went away): one line. A
        setting that can never work (MemoryTargetError) is its own one line, for the CLI's exit 2."""
        setting = isinstance(exc, MemoryTargetError)
        trace = trace and not setting
        text = str(exc) if setting else "".join(traceback.format_exception_only(type(exc), exc)).strip()
        log.error("rank failed during %s: %s%s", stage, text, "\n" + traceback.format_exc() if trace else "")
        with contextlib.suppress(zmq.ZMQError):
            self.status.send_multipart(
                m.encode(
                    m.ErrorMsg(
                        group=self.args.group,
                        rank=self.args.rank,
                        stage=stage,
                        message=text,
                        batch_id=batch_id,
                        setting=setting,
                    )
                )
            )

    def exit(self, code: int) -> None:
        """Leave the process without running collective teardown: a peer may be dead, and barriers would hang."""
        self.close(code)
        os._exit(code)

    def close(self, code: int) -> None:
        """Stop liveness and close the sockets (flushing a last RESULT/ERROR); after a clean STOP (code 0)
        also remove the published reservation."""
        if code == 0:
            self._remove_reservation()
        liveness = getattr(self, "liveness", None)
        if liveness is not None:
            liveness.stop()
            liveness.join(timeout=1.0)
        if self.inbox is not None:
            self.inbox.close(linger=0)
        self.status.close(linger=2000)
        if liveness is None or not liveness.is_alive():  # term() waits for every socket to be closed
            self.ctx.term()  # blocks until the last RESULT/ERROR is flushed (or the linger passes)

    def _remove_reservation(self) -> None:
        if getattr(self, "reservation", None) is None:  # a killed rank's file: published.remove_killed
            return
        remove_reservation(self.cfg.runtime_dir, self.device.type, self.args.global_rank)
