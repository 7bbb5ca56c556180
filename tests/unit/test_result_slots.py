"""Result slots (vitserve/worker/slots.py), in one process: rank 0 writes a result into a memfd the engine lent, the engine's
tensors are views of its mapping, and the slot comes back when the last of them is gone."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from vitserve.contract import EncodedImage
from vitserve.worker import messages as m
from vitserve.worker.slots import ALIGN, ResultSlots, slot_bytes, spans_for, write_slot

pytestmark = pytest.mark.skipif(not ResultSlots().enabled, reason="needs memfd_create and /proc (Linux)")


def _result(rows: int = 5, width: int = 8, levels: int = 2, seed: int = 0) -> m.ResultMsg:
    g = torch.Generator().manual_seed(seed)
    out = EncodedImage(
        embedding=torch.randn(rows, width, generator=g),
        deepstack=[torch.randn(rows, width, generator=g) for _ in range(levels)],
    )
    return m.ResultMsg(group=0, batch_id=7, outputs=[out, out], forward_s=0.5)


def test_spans_are_aligned_and_side_by_side():
    assert spans_for([10, 64, 1]) == [(0, 10), (64, 64), (128, 1)]
    assert all(off % ALIGN == 0 for off, _ in spans_for([3, 5, 7, 129]))
    assert slot_bytes([10, 64, 1]) == 129
    assert slot_bytes([]) == 0


def test_a_result_written_into_its_slot_decodes_to_views_of_the_engines_mapping():
    # another process (a real rank 0) writes it in tests/integration/test_engine.py
    slots = ResultSlots(min_bytes=0)
    msg = _result()
    frames = m.encode(msg)
    name = slots.lend(slot_bytes([memoryview(f).nbytes for f in frames[1:]]))
    assert name.startswith(f"/proc/{os.getpid()}/fd/")
    spans = write_slot(name, frames[1:])  # it opens the /proc path, as rank 0 does
    assert spans is not None
    got = m.decode(m.in_slot(frames, name, spans), slots.buffers)
    assert isinstance(got, m.ResultMsg)
    assert (got.group, got.batch_id, got.forward_s) == (0, 7, 0.5)
    for a, b in zip(got.outputs, msg.outputs, strict=True):
        assert torch.equal(a.embedding, b.embedding)
        assert all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack, strict=True))
    # no copy: a write into the decoded tensor is a write into the slot's pages
    got.outputs[1].deepstack[1][0, 0] = 1234.5
    fd = int(name.rsplit("/", 1)[1])
    offset, _ = spans[5]
    assert torch.frombuffer(bytearray(os.pread(fd, 4, offset)), dtype=torch.float32).item() == 1234.5
    assert slots.read == 1
    slots.close()


def test_the_slot_is_held_while_any_tensor_over_it_lives_then_lent_again():
    slots = ResultSlots(max_slots=1, min_bytes=0)
    frames = m.encode(_result())
    name = slots.lend(100)
    spans = write_slot(name, frames[1:])
    assert spans is not None
    msg = m.decode(m.in_slot(frames, name, spans), slots.buffers)
    assert isinstance(msg, m.ResultMsg)
    keep = msg.outputs[0].deepstack[0][1:3]  # a view of one tensor is enough to hold it
    del msg
    gc.collect()
    assert slots.states() == ["held"]
    assert slots.lend(100) == ""  # the only slot is held: the next result comes as frames
    del keep
    gc.collect()
    assert slots.states() == ["free"]
    assert slots.lend(100) == name  # its pages exist already: the same slot again
    slots.close()


def test_free_slots_beyond_keep_free_are_closed_and_lend_prefers_one_that_fits():
    slots = ResultSlots(max_slots=4, keep_free=1, min_bytes=0)
    a, b = slots.lend(10), slots.lend(10)
    assert a != b
    assert slots.states() == ["lent", "lent"]
    slots.give_back(a)
    slots.give_back(b)  # one free is kept; the other is closed
    assert slots.states() == ["free"]
    big = slots.lend(1000)
    assert write_slot(big, [bytes(1000)]) == [(0, 1000)]
    views = slots.buffers(big, [[0, 1000]])
    del views
    gc.collect()
    assert slots.lend(600) == big  # the free one holds it, and not more than twice it
    slots.give_back(big)
    assert slots.lend(10) != big  # 1000 bytes would be held for 10: a new slot instead
    slots.close()


def test_a_slot_not_lent_or_a_span_past_what_was_written_is_refused_and_the_slot_freed():
    slots = ResultSlots(min_bytes=0)
    with pytest.raises(ValueError, match="was not lent"):
        slots.buffers("/proc/1/fd/3", [[0, 4]])
    name = slots.lend(64)
    write_slot(name, [bytes(16)])
    with pytest.raises(ValueError, match="holds 16"):
        slots.buffers(name, [[0, 32]])
    assert slots.states() == ["free"]
    name = slots.lend(64)
    with pytest.raises(ValueError, match="negative"):
        slots.buffers(name, [[-8, 8]])
    assert slots.states() == ["free"]
    slots.close()


def test_decode_refuses_a_slot_message_where_none_was_lent_and_names_the_batch_otherwise():
    frames = m.encode(_result())
    slotted = m.in_slot(frames, "/proc/1/fd/3", [(0, 8)] * 6)
    with pytest.raises(m.MessageError, match="none was lent"):
        m.decode(slotted)
    slots = ResultSlots(min_bytes=0)
    with pytest.raises(m.SlotError, match="batch 7") as err:
        m.decode(slotted, slots.buffers)
    assert (err.value.group, err.value.batch_id) == (0, 7)
    name = slots.lend(64)
    write_slot(name, [bytes(8)])
    with pytest.raises(m.MessageError, match="6 tensors but 1 spans follow"):  # the count, named as spans
        m.decode(m.in_slot(frames, name, [(0, 8)]), slots.buffers)
    with pytest.raises(m.MessageError, match="bad result slot spans"):
        m.decode(m.in_slot(frames, "/proc/1/fd/3", [(0, "8")] * 6), slots.buffers)  # type: ignore[list-item]
    slots.close()


def test_an_unwritable_slot_leaves_the_frames_and_a_retired_slot_is_never_lent_again():
    assert write_slot("/proc/self/fd/999999", [bytes(8)]) is None
    slots = ResultSlots(max_slots=1, min_bytes=0)
    name = slots.lend(8)
    write_slot(name, [bytes(8)])
    slots.retire(name)
    fd = int(name.rsplit("/", 1)[1])
    assert os.fstat(fd).st_size == 0  # emptied; its fd stays open so the number names nothing else
    assert slots.states() == []
    assert slots.lend(8) != name
    slots.close()


def test_a_view_that_dies_while_the_slots_lock_is_held_frees_its_slot_later_without_a_deadlock():
    # the cyclic GC may run a finalizer in the middle of one of ResultSlots' own methods, under its lock
    slots = ResultSlots(min_bytes=0)
    name = slots.lend(16)
    write_slot(name, [bytes(16)])
    views = slots.buffers(name, [[0, 16]])
    done = threading.Event()

    def drop_under_the_lock():
        nonlocal views
        with slots._lock:
            views = None  # the last view goes: its finalizer runs here, in this thread
            gc.collect()
        done.set()

    worker = threading.Thread(target=drop_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "a finalizer waited for the lock its own thread holds"
    assert slots.states() == ["free"]
    slots.close()


def test_a_result_under_min_bytes_comes_as_frames():
    slots = ResultSlots(min_bytes=1000)
    assert slots.lend(999) == ""
    assert slots.lend(1000) != ""
    slots.close()


def test_a_batch_names_its_slot():
    batch = m.BatchMsg(batch_id=3, items=[], slot="/proc/1/fd/9")
    assert m.decode(m.encode(batch)) == batch
    assert m.decode(m.encode(m.BatchMsg(batch_id=4, items=[]))).slot == ""  # type: ignore[union-attr]
