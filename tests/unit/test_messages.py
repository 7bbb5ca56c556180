"""vitserve/worker/messages.py: typed internal messages round-trip; garbage and pickle are refused."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.worker import messages as m


def _roundtrip(msg):
    return m.decode([bytes(f) for f in m.encode(msg)])


def test_batch_roundtrip_keeps_items_and_order():
    items = [
        ProcessedImage(torch.randn(16, 12), (1, 4, 4), 4, (56, 56), False),
        ProcessedImage(torch.randn(8, 12).to(torch.bfloat16), (1, 2, 4), 2, (56, 28), True),
    ]
    out = _roundtrip(m.BatchMsg(batch_id=7, items=items))
    assert isinstance(out, m.BatchMsg)
    assert out.batch_id == 7
    for a, b in zip(items, out.items, strict=True):
        assert torch.equal(a.pixel_values, b.pixel_values)
        assert (a.grid_thw, a.num_tokens, a.resized_size, a.clamped) == (
            b.grid_thw,
            b.num_tokens,
            b.resized_size,
            b.clamped,
        )


def test_result_roundtrip_with_deepstack():
    outs = [
        EncodedImage(torch.randn(3, 5), [torch.randn(3, 5), torch.randn(3, 5)]),
        EncodedImage(torch.randn(2, 5)),
    ]
    got = _roundtrip(m.ResultMsg(group=1, batch_id=3, outputs=outs))
    assert isinstance(got, m.ResultMsg)
    assert (got.group, got.batch_id) == (1, 3)
    for a, b in zip(outs, got.outputs, strict=True):
        assert torch.equal(a.embedding, b.embedding)
        assert len(a.deepstack) == len(b.deepstack)
        assert all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack, strict=True))


@pytest.mark.parametrize(
    "msg",
    [
        m.StopMsg(),
        m.AliveMsg(group=0, rank=1, heartbeats=5, batches=2),
        m.ErrorMsg(group=0, rank=1, stage="forward", message="boom", batch_id=4),
        m.ReadyMsg(
            group=0,
            rank=0,
            pid=1,
            model_name="x",
            family="qwen2_vl",
            embed_dim=8,
            num_deepstack=0,
            dtype="float32",
            device="cpu",
            reserved_bytes=10,
            reserved_source="stress",
            weights_digest="ab" * 32,
        ),
    ],
)
def test_plain_messages_roundtrip(msg):
    assert _roundtrip(msg) == msg


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\x00garbage"],
        [pickle.dumps({"v": 1, "kind": "stop"})],
        [msgpack.packb({"v": 2, "kind": "stop", "tensors": []})],  # unknown version
        [msgpack.packb({"v": 1, "kind": "nope", "tensors": []})],  # unknown kind
        [msgpack.packb({"v": 1, "kind": "heartbeat", "tensors": []})],  # never travels on ZMQ
        [msgpack.packb({"v": 1, "kind": "alive", "group": 0, "tensors": []})],  # missing fields
        [
            msgpack.packb(
                {
                    "v": 1,
                    "kind": "alive",
                    "group": 0,
                    "rank": 0,
                    "heartbeats": 0,
                    "batches": 0,
                    "x": 1,
                    "tensors": [],
                }
            )
        ],  # unknown field
        [
            msgpack.packb(
                {
                    "v": 1,
                    "kind": "result",
                    "group": 0,
                    "batch_id": 0,
                    "deepstack_counts": [0],
                    "tensors": [["float32", [2, 2]]],
                }
            ),
            b"\x00" * 15,
        ],  # frame size does not match
        [
            msgpack.packb(
                {
                    "v": 1,
                    "kind": "result",
                    "group": 0,
                    "batch_id": 0,
                    "deepstack_counts": [1],
                    "tensors": [["float32", [1]]],
                }
            ),
            b"\x00" * 4,
        ],  # counts disagree with frames
    ],
)
def test_malformed_frames_raise_message_error(frames):
    with pytest.raises(m.MessageError):
        m.decode(frames)
