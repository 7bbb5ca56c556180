"""Result slots: rank 0 writes a batch's embeddings into shared memory the engine lent it, not through the
status socket.

Why: a RESULT's tensors through ZMQ cost a kernel copy into fresh pages of the engine's heap, and at real
widths the page faults are most of it (1080p at 16,384 wide, 133 MB of float32: ~90 ms idle, 130-550 ms on
busy cores; bench/RESULTS.md "The rank's result in shared memory"). A slot is a memfd the engine keeps:
rank 0 overwrites its pages (a kernel copy into pages that already exist), the engine keeps a mapping of it,
and the result's tensors are views of that mapping: no copy and no page fault on the engine's side.

Protocol (engine/dispatch.py, worker/rank.py, worker/messages.py):
- the engine lends one slot per batch (`BatchMsg.slot`: a /proc path to one of its memfds; "" for none) when
  the result has MIN_BYTES or more and a slot can be had (at most MAX_SLOTS slots, KEEP_FREE kept between uses);
- rank 0 writes the result's tensor frames into it (`write_slot`) and sends the RESULT with their spans in
  place of the frames; where it cannot (any OSError: no /proc, no memory), it sends the frames as before;
- the engine turns the spans into views (`ResultSlots.buffers`); the slot is held until the last tensor over
  it is gone (a finalizer), then free again. A result without spans gives its slot back; a group that fails
  with a batch in flight retires that batch's slot: truncated and never lent again (a rank being killed may
  still write it).
A memfd is not in /dev/shm (no size of its own: a container's 64 MB /dev/shm does not limit it) and goes with
the last process that holds it: nothing is left behind by a crash.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)
ALIGN = 64  # bytes: every tensor starts on a 64-byte boundary of the slot
MAX_SLOTS = 8  # lent + held + free: beyond it a batch's result comes through the socket
KEEP_FREE = 2  # free slots kept for the next results (their pages already exist); more are closed
# Smaller results come as frames: glibc serves an allocation below its mmap threshold (at most 32 MiB) from heap
# pages it reuses, so zmq's copy of them costs no page faults, and a slot measured no faster there (3.7-29 MB:
# 1.03-1.38x the frames' median; 133.7 MB: 0.33x; bench/RESULTS.md "The rank's result in shared memory")
MIN_BYTES = 32 * 2**20


def spans_for(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor in a slot: side by side, each on an ALIGN boundary."""
    spans, offset = [], 0
    for n in sizes:
        spans.append((offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return spans


def slot_bytes(sizes: Sequence[int]) -> int:
    """The bytes a slot needs for tensors of these sizes."""
    return max((off + n for off, n in spans_for(sizes)), default=0)


def write_slot(name: str, frames: Sequence[memoryview | bytes]) -> list[tuple[int, int]] | None:
    """Rank 0: the frames written into the slot `name`, their spans; None where it could not (logged)."""
    spans = spans_for([memoryview(f).nbytes for f in frames])
    try:
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        try:
            for (offset, n), frame in zip(spans, frames, strict=True):
                view = memoryview(frame).cast("B")
                done = 0
                while done < n:  # pwrite may stop short (a signal); go on from there
                    done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("the result goes through the status socket: slot %s cannot be written (%s)", name, exc)
        return None
    return spans


@dataclass(eq=False)
class _Slot:
    fd: int
    name: str  # what a rank opens: /proc/<engine pid>/fd/<fd>
    size: int = 0  # bytes written into it so far (a memfd only grows here)
    mapping: mmap.mmap | None = None  # the engine's; replaced when the slot grew past it
    state: str = "free"  # free -> lent -> held (views alive) -> free; or retired


class ResultSlots:
    """The engine's side: memfds lent to rank 0s, one per batch in flight, and views of what they wrote.

    Thread-safe: the views' finalizers run wherever the last reference goes (the event loop, a hand-over
    thread, or the cyclic GC in the middle of one of these methods), so a finalizer only queues its slot, and
    each method frees what is queued under the lock first."""

    def __init__(self, max_slots: int = MAX_SLOTS, keep_free: int = KEEP_FREE, min_bytes: int = MIN_BYTES):
        self.max_slots, self.keep_free, self.min_bytes = max_slots, keep_free, min_bytes
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._retired: list[_Slot] = []
        self._released: collections.deque[_Slot] = collections.deque()  # held slots whose views are gone
        self.read = 0  # results read from a slot (their tensors over it)
        self.enabled = hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")

    def lend(self, nbytes: int) -> str:
        """A slot for a result of `nbytes` (its name, now lent), or "" when none is to be had."""
        if not self.enabled or nbytes <= 0 or nbytes < self.min_bytes:
            return ""
        with self._lock:
            self._drain()
            free = sorted((s for s in self._slots.values() if s.state == "free"), key=lambda s: s.size)
            # one that holds it without growing and without pinning more than twice it (a held result keeps
            # its whole slot); else one smaller (it grows); else a new one; else whatever is free
            fits = [s for s in free if nbytes <= s.size <= 2 * nbytes]
            smaller = [s for s in free if s.size < nbytes]
            slot = fits[0] if fits else smaller[-1] if smaller else None
            if slot is None and len(self._slots) < self.max_slots:
                slot = self._new()
            if slot is None and free:
                slot = free[0]
            if slot is None:
                return ""
            slot.state = "lent"
            return slot.name

    def give_back(self, name: str) -> None:
        """A lent slot its result did not use."""
        with self._lock:
            self._drain()
            slot = self._slots.get(name)
            if slot is not None and slot.state == "lent":
                self._free(slot)

    def retire(self, name: str) -> None:
        """A lent slot whose rank failed: it may still be written, so it is emptied and never lent again (its
        fd stays open until close, so its number cannot name another slot meanwhile)."""
        with self._lock:
            self._drain()
            slot = self._slots.get(name)
            if slot is None or slot.state != "lent":  # a held slot's views must keep their pages
                return
            del self._slots[name]
            slot.state = "retired"
            os.ftruncate(slot.fd, 0)
            slot.mapping = None
            self._retired.append(slot)

    def buffers(self, name: str, spans: Sequence[Sequence[int]]) -> list[memoryview]:
        """Writable views of the spans rank 0 wrote into the lent slot `name`, which is held until every view
        (and every tensor over one) is gone. ValueError for a slot not lent or a span outside what was written."""
        with self._lock:
            self._drain()
            slot = self._slots.get(name)
            if slot is None or slot.state != "lent":
                raise ValueError(f"result slot {name!r} was not lent")
            try:
                base = self._view(slot, spans)
            except (ValueError, OSError):
                self._free(slot)
                raise
            if base is None:  # nothing written (empty tensors): nothing to map
                self._free(slot)
                return [memoryview(bytearray()) for _ in spans]
            slot.state = "held"
            self.read += 1
            weakref.finalize(base, self._release, slot)
        return [memoryview(base[off : off + n]) for off, n in spans]  # type: ignore[arg-type]  # ndarray exports a buffer

    def states(self) -> list[str]:
        """Each slot's state (free, lent, held), for tests and logs."""
        with self._lock:
            self._drain()
            return sorted(s.state for s in self._slots.values())

    def close(self) -> None:
        """Close every slot (the views still alive keep their mappings)."""
        with self._lock:
            self._drain()
            for slot in [*self._slots.values(), *self._retired]:
                os.close(slot.fd)
            self._slots.clear()
            self._retired.clear()
            self.enabled = False

    # ----------------------------------------------------------------------------------------- inside

    def _view(self, slot: _Slot, spans: Sequence[Sequence[int]]) -> np.ndarray | None:
        """The slot's bytes up to the end of the last span, over the engine's mapping; None for none."""
        end = max((off + n for off, n in spans), default=0)
        if any(off < 0 or n < 0 for off, n in spans):
            raise ValueError(f"negative spans {list(spans)!r} of result slot {slot.name!r}")
        if end == 0:
            return None
        size = os.fstat(slot.fd).st_size
        if end > size:
            raise ValueError(f"spans up to byte {end} of result slot {slot.name!r}, which holds {size}")
        slot.size = size
        if slot.mapping is None or len(slot.mapping) < size:  # views of an older mapping keep that one alive
            slot.mapping = mmap.mmap(slot.fd, size)
        return np.frombuffer(slot.mapping, dtype=np.uint8, count=end)

    def _new(self) -> _Slot:
        fd = os.memfd_create("vitserve-result-slot", os.MFD_CLOEXEC)
        slot = _Slot(fd=fd, name=f"/proc/{os.getpid()}/fd/{fd}")
        self._slots[slot.name] = slot
        return slot

    def _release(self, slot: _Slot) -> None:
        self._released.append(slot)  # no lock here: this may run inside a method that holds it

    def _drain(self) -> None:
        while self._released:
            slot = self._released.popleft()
            if slot.state == "held" and self._slots.get(slot.name) is slot:
                self._free(slot)

    def _free(self, slot: _Slot) -> None:
        free = sum(1 for s in self._slots.values() if s.state == "free")
        if free >= self.keep_free:  # enough kept: this one's pages go (with its mapping, once unused)
            del self._slots[slot.name]
            os.close(slot.fd)
            slot.mapping = None
            return
        slot.state = "free"
