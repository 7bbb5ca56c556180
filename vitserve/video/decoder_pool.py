"""The video decoder pool: PyAV runs in spawned processes, one per slot, each under memory and CPU limits and
a wall deadline, killed and replaced when it crashes or hangs (docs/processing.md "Decoding").

Usage (thread-safe; each call takes a free slot, blocking until one is)::

    decoder = VideoDecoder(slots=2, limits=VideoLimits.from_config(config))
    info = decoder.probe(data, deadline_s=30)
    frames = decoder.decode(data, indices, (width, height), deadline_s=30)  # (n, height, width, 3) uint8
    decoder.close()

A decoder runs foreign bitstreams through FFmpeg: a bug there must cost one request, never the server.
- memory: RLIMIT_AS = the process's address space once started + ``memory_bytes``; an allocation past it
  fails inside FFmpeg, numpy or torch and the call is a 400;
- CPU: RLIMIT_CPU, reset before each call to the CPU time used so far + ``cpu_s``; past it the kernel's
  SIGXCPU ends the process: a 504, as is the wall deadline (the parent waits ``deadline_s``, then kills it);
- a process that dies on a call (a signal, an exit) costs that call a 400 naming the signal;
- priority: nice +``DECODER_NICE``, so a core the decoders share with the API process and the ranks goes to
  images first (a video's decode takes seconds of CPU; an image's preprocess and encode, milliseconds);
- a killed or dead process is replaced at once; the replacement starts in the background and the next call
  on its slot waits for its ready message.
Messages are the typed ``Job`` and ``Reply``; errors cross as (code, message), never pickled exceptions.
"""

from __future__ import annotations

import enum
import math
import os
import queue
import resource
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from vitserve import processes
from vitserve.config import GIB
from vitserve.errors import (
    InvalidVideo,
    NotReady,
    PayloadTooLarge,
    UnsupportedVideo,
    VideoDecodeTimeout,
    VitserveError,
)
from vitserve.video.decode import VideoInfo, VideoLimits

# added to a decoder process's nice value: a CFS weight of about 1/10 of the server's threads
DECODER_NICE = 10
_READY = "ready"  # a slot's first message, once its imports are done and its limits set
_ERRORS: dict[str, type[VitserveError]] = {
    cls.code: cls for cls in (InvalidVideo, UnsupportedVideo, PayloadTooLarge, VideoDecodeTimeout)
}


class Op(enum.Enum):
    PROBE = "probe"
    DECODE = "decode"


@dataclass(frozen=True)
class Job:
    """One call to a decoder process."""

    op: Op
    data: bytes  # the video file
    limits: VideoLimits
    cpu_s: float  # CPU seconds this call may use (the kernel counts whole seconds: up to 1 s more)
    indices: tuple[int, ...] = ()  # DECODE: the frames to decode, 0-based in presentation order
    size: tuple[int, int] | None = None  # DECODE: (width, height) to resize to; None: the frames' own size


@dataclass(frozen=True)
class Reply:
    """A decoder process's answer: the probe's info, the frames, or an error by its code."""

    info: VideoInfo | None = None
    frames: np.ndarray | None = None  # (n, height, width, 3) uint8
    error_code: str | None = None  # a code of _ERRORS
    error_message: str = ""


@dataclass(frozen=True)
class ProcessLimits:
    """What one decoder process may use."""

    memory_bytes: int  # address space on top of what the started process maps (RLIMIT_AS)
    threads: int  # FFmpeg decoding threads per process


def _child_main(conn: Connection, limits: ProcessLimits) -> None:
    """A decoder process: import, set the limits, say ready, then answer jobs until the pipe closes."""
    import torch

    from vitserve.video.decode import decode_frames, error_reply, probe
    from vitserve.video.memory import pin_mmap_threshold

    torch.set_num_threads(1)  # a per-frame resize; the pool's slots are the parallelism
    os.nice(DECODER_NICE)  # before FFmpeg starts its threads, which inherit it
    pin_mmap_threshold()  # each call's frames are freed to the OS, not kept as heap (video/memory.py)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file
    address_space = _address_space() + limits.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    conn.send(_READY)
    while True:
        try:
            job: Job = conn.recv()
        except EOFError:  # the pool closed or its process died
            return
        _limit_cpu(job.cpu_s)
        try:
            if job.op is Op.PROBE:
                reply = Reply(info=probe(job.data, job.limits))
            else:
                frames = decode_frames(job.data, job.indices, job.size, job.limits, limits.threads)
                reply = Reply(frames=frames)
        except Exception as exc:  # every failure is an answer; MemoryError included
            code, message = error_reply(exc)
            if isinstance(exc, MemoryError) or isinstance(exc.__cause__, MemoryError):
                message = (
                    f"decoding the video needed more memory than a decoder process may use (its size at start "
                    f"+ {limits.memory_bytes / GIB:g} GiB, VideoDecoder's memory_bytes)"
                )
            reply = Reply(error_code=code, error_message=message)
        del job
        conn.send(reply)


def _address_space() -> int:
    """Bytes of virtual address space this process maps now (VmSize)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _limit_cpu(cpu_s: float) -> None:
    """Soft RLIMIT_CPU = CPU seconds used so far + cpu_s, rounded up to whole seconds (the hard limit stays, so
    the next call can raise it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    resource.setrlimit(
        resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


class _Slot:
    """One decoder process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, limits: ProcessLimits) -> None:
        self.ctx, self.limits = ctx, limits
        self.process: Any = None
        self.conn: Connection | None = None
        self.ready = False
        self.start()

    def start(self) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        self.process = self.ctx.Process(
            target=_child_main, args=(child, self.limits), name="vitserve-video-decoder", daemon=True
        )
        self.process.start()
        child.close()
        self.conn, self.ready = parent, False

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process's ready message: False if it has not come; RuntimeError
        if the process failed to start."""
        if self.ready:
            return True
        assert self.conn is not None
        if not self.conn.poll(max(0.0, timeout_s)):
            return False
        try:
            message = self.conn.recv()
        except EOFError:
            message = None
        if message != _READY:
            raise RuntimeError(f"a video decoder process failed to start (exit code {self.process.exitcode})")
        self.ready = True
        return True

    def replace(self) -> int | None:
        """Kill the process (if alive), reap it and start another; returns the old process's exit code."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        exitcode: int | None = self.process.exitcode
        if self.conn is not None:
            self.conn.close()
        self.start()
        return exitcode

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the process sees EOF and exits
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class VideoDecoder:
    """A pool of ``slots`` decoder processes (forked from the warm forkserver, else spawned:
    vitserve/processes/__init__.py), each call on one free slot."""

    def __init__(
        self,
        slots: int = 2,
        *,
        limits: VideoLimits | None = None,
        memory_bytes: int = 4 * GIB,
        threads: int = 2,
        cpu_s: float | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        """``cpu_s``: CPU seconds one call may use; None = its wall deadline x (threads + 1), a backstop that
        ends a call left running (e.g. by a parent that died) rather than the usual limit."""
        if slots < 1:
            raise ValueError(f"a video decoder needs at least one slot, got {slots}")
        self.limits = limits or VideoLimits()
        self.cpu_s = cpu_s
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        ctx = processes.context()  # forked from the ranks' warm forkserver when the CLI runs one
        process_limits = ProcessLimits(memory_bytes=memory_bytes, threads=threads)
        self._slots = [_Slot(ctx, process_limits) for _ in range(slots)]
        self._free: queue.Queue[_Slot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)

    def wait_ready(self) -> None:
        """Block until every slot's process has started (a start-up handshake, never a sleep)."""
        for slot in self._slots:
            if not slot.wait_ready(self.start_timeout_s):
                raise RuntimeError(f"a video decoder process did not start in {self.start_timeout_s:g} s")

    def pids(self) -> list[int]:
        return [slot.process.pid for slot in self._slots]

    def probe(self, data: bytes, *, deadline_s: float) -> VideoInfo:
        """The video's checked header and frame count (decode.probe, in a decoder process)."""
        self.limits.check_bytes(len(data))  # before shipping it anywhere
        reply = self._run(Op.PROBE, data, deadline_s)
        assert reply.info is not None
        return reply.info

    def decode(
        self, data: bytes, indices: tuple[int, ...], size: tuple[int, int] | None, *, deadline_s: float
    ) -> np.ndarray:
        """(len(indices), height, width, 3) uint8: the frames at ``indices`` resized to ``size`` = (width,
        height) in a decoder process (decode.decode_frames)."""
        self.limits.check_bytes(len(data))
        reply = self._run(Op.DECODE, data, deadline_s, tuple(indices), size)
        assert reply.frames is not None
        return reply.frames

    def close(self) -> None:
        for slot in self._slots:
            slot.stop()

    def __enter__(self) -> VideoDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, op: Op, data: bytes, deadline_s: float, *args: Any) -> Reply:
        cpu_s = self.cpu_s if self.cpu_s is not None else deadline_s * (self.threads + 1)
        job = Job(op, data, self.limits, cpu_s, *args)
        end = time.monotonic() + deadline_s  # the deadline covers waiting for a slot and for its start
        try:
            slot = self._free.get(timeout=max(0.0, deadline_s))
        except queue.Empty:
            raise _timeout(deadline_s, "every video decoder was busy until then") from None
        try:
            if not slot.process.is_alive():  # died between calls (or while starting): a fresh one
                slot.replace()
            try:
                ready = slot.wait_ready(min(self.start_timeout_s, end - time.monotonic()))
            except RuntimeError as exc:
                slot.replace()
                raise NotReady(f"the video decoder could not start: {exc}") from exc
            if not ready:
                raise _timeout(deadline_s, "a video decoder process was still starting")
            return self._call(slot, job, end - time.monotonic(), deadline_s)
        finally:
            self._free.put(slot)

    def _call(self, slot: _Slot, job: Job, wait_s: float, deadline_s: float) -> Reply:
        """The job on the slot's process, waiting ``wait_s`` (what is left of ``deadline_s``) for its reply."""
        assert slot.conn is not None
        try:
            slot.conn.send(job)
            answered = slot.conn.poll(max(0.0, wait_s))
            reply = slot.conn.recv() if answered else None
        except (EOFError, OSError):  # the process died: its pipe closed
            reply, answered = None, True
        if reply is None and not answered:
            slot.replace()
            raise _timeout(deadline_s, "the decoder was stopped")
        if not isinstance(reply, Reply):
            raise self._died(slot, job)
        if reply.error_code is not None:
            raise _ERRORS.get(reply.error_code, InvalidVideo)(reply.error_message)
        return reply

    def _died(self, slot: _Slot, job: Job) -> VitserveError:
        """The error for a call whose process died under it; the process is replaced."""
        exitcode = slot.replace()
        if exitcode == -signal.SIGXCPU:
            return VideoDecodeTimeout(
                f"decoding the video used more than its {job.cpu_s:g} s of CPU time (the request's deadline "
                "under --request_timeout_s, times the decoder's threads); the decoder was stopped"
            )
        how = (
            f"signal {signal.Signals(-exitcode).name}"
            if exitcode and exitcode < 0
            else f"exit code {exitcode}"
        )
        return InvalidVideo(f"the video decoder crashed on this video ({how}); the decoder was replaced")


def _timeout(deadline_s: float, what: str) -> VideoDecodeTimeout:
    return VideoDecodeTimeout(
        f"decoding the video took longer than its deadline of {deadline_s:g} s (the request's remaining time "
        f"under --request_timeout_s): {what}"
    )
