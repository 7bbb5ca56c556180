"""Wire-format v3 codec (docs/wire.md): exact frames, byte-identical round trips, and strict rejection of anything else."""

from __future__ import annotations

import contextlib
import os
import pickle

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from vitserve.rpc.wire import (
    ImageEmbedding,
    VideoGroupRef,
    WireError,
    decode_ack,
    decode_embedding_message,
    encode_ack,
    encode_embedding_message,
)

SPEC_KEYS = {
    "v", "message_id", "expires_at", "request_id", "image_index", "num_images", "image_id", "model", "grid_thw",
    "num_tokens", "dtype", "shape", "deepstack_shapes",
}  # fmt: skip


def make_frames(dtype=torch.float32, tokens=6, dim=8, n_deepstack=2, **over):
    g = torch.Generator().manual_seed(0)
    fields = {
        "request_id": "r-1",
        "image_index": 1,
        "num_images": 3,
        "image_id": "ab" * 32,
        "model": "tiny",
        "grid_thw": (1, 4, 6),
        "message_id": "m-1",
        "expires_at": 1.9e9,
        "embedding": torch.randn(tokens, dim, generator=g).to(dtype),
        "deepstack": [torch.randn(tokens, dim, generator=g).to(dtype) for _ in range(n_deepstack)],
    }
    fields.update(over)
    return fields, encode_embedding_message(ImageEmbedding(**fields))


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("as_type", [bytes, bytearray])
def test_round_trip_is_byte_identical(dtype, as_type):
    fields, frames = make_frames(dtype)
    msg = decode_embedding_message([as_type(f) for f in frames])
    assert isinstance(msg, ImageEmbedding)
    assert (msg.request_id, msg.image_index, msg.num_images, msg.image_id, msg.model) == (
        "r-1", 1, 3, "ab" * 32, "tiny",
    )  # fmt: skip
    assert msg.grid_thw == (1, 4, 6)
    assert msg.num_tokens == 6
    assert (
        msg.dtype == {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    )
    assert same_bytes(msg.embedding, fields["embedding"])
    assert len(msg.deepstack) == 2
    for got, want in zip(msg.deepstack, fields["deepstack"], strict=True):
        assert same_bytes(got, want)


def test_frames_follow_the_spec_exactly():
    fields, frames = make_frames(torch.float16, n_deepstack=1)
    assert len(frames) == 3
    header = msgpack.unpackb(frames[0], raw=False)
    assert set(header) == SPEC_KEYS
    assert header == {
        "v": 3, "message_id": "m-1", "expires_at": 1.9e9, "request_id": "r-1", "image_index": 1, "num_images": 3, "image_id": "ab" * 32,
        "model": "tiny", "grid_thw": [1, 4, 6], "num_tokens": 6, "dtype": "float16", "shape": [6, 8],
        "deepstack_shapes": [[6, 8]],
    }  # fmt: skip
    # Little-endian, C-contiguous raw bytes.
    assert bytes(frames[1]) == fields["embedding"].numpy().astype("<f2").tobytes(order="C")
    assert bytes(frames[2]) == fields["deepstack"][0].numpy().astype("<f2").tobytes(order="C")


def test_no_deepstack_means_two_frames_and_empty_list():
    _, frames = make_frames(n_deepstack=0)
    assert len(frames) == 2
    assert msgpack.unpackb(frames[0])["deepstack_shapes"] == []
    assert decode_embedding_message(frames).deepstack == []


def test_encode_is_zero_copy_for_contiguous_tensors():
    fields, frames = make_frames()
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == fields["embedding"].data_ptr()


def test_decode_is_zero_copy_over_writable_frames():
    _, frames = make_frames()
    buf = bytearray(frames[1])
    msg = decode_embedding_message([frames[0], buf, *frames[2:]])
    assert msg.embedding.data_ptr() == np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_non_contiguous_tensor_is_sent_as_its_contiguous_values():
    t = torch.arange(48, dtype=torch.float32).reshape(8, 6).t()  # (6, 8), not contiguous
    _, frames = make_frames(embedding=t, deepstack=[])
    assert torch.equal(decode_embedding_message(frames).embedding, t)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"embedding": torch.zeros(2, 3, 4)}, "2-D"),
        ({"embedding": torch.zeros(2, 3, dtype=torch.int32), "deepstack": []}, "not one of"),
        ({"deepstack": [torch.zeros(6, 8, dtype=torch.float16)]}, "differs"),
        ({"image_index": 3}, "below num_images"),
        ({"request_id": 7}, "request_id"),
    ],
)
def test_encode_refuses_what_a_receiver_would_reject(over, match):
    with pytest.raises(WireError, match=match):
        make_frames(**over)


def _with_header(frames, **changes):
    header = msgpack.unpackb(frames[0], raw=False)
    for key, value in changes.items():
        if value is _DELETE:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header), *frames[1:]]


_DELETE = object()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"v": 1}, "unknown wire version 1; this receiver speaks v3"),
        ({"v": 2}, "unknown wire version 2"),
        ({"v": "3"}, "unknown wire version"),
        ({"message_id": _DELETE}, "message_id"),
        ({"message_id": ""}, "message_id"),
        ({"message_id": 5}, "message_id"),
        ({"message_id": "x" * 257}, "message_id"),
        ({"expires_at": _DELETE}, "expires_at"),
        ({"expires_at": 1900000000}, "expires_at"),  # an int, not a float
        ({"expires_at": float("nan")}, "expires_at"),
        ({"expires_at": float("inf")}, "expires_at"),
        ({"traceparent": None}, "traceparent"),
        ({"traceparent": ""}, "traceparent"),
        ({"v": True}, "unknown wire version"),
        ({"v": _DELETE}, "unknown wire version"),
        ({"request_id": _DELETE}, "request_id"),
        ({"request_id": b"r-1"}, "request_id"),
        ({"image_id": None}, "image_id"),
        ({"model": 3}, "model"),
        ({"image_index": -1}, "image_index"),
        ({"image_index": 1.0}, "image_index"),
        ({"num_images": True}, "num_images"),
        ({"num_tokens": _DELETE}, "num_tokens"),
        ({"image_index": 3}, "below num_images"),
        ({"dtype": "int64"}, "not one of"),
        ({"dtype": _DELETE}, "dtype"),
        ({"grid_thw": [1, 4]}, "grid_thw"),
        ({"grid_thw": "1,4,6"}, "grid_thw"),
        ({"shape": [6, 8, 1]}, "shape"),
        ({"shape": [6, True]}, "shape"),
        ({"shape": _DELETE}, "shape"),
        ({"num_tokens": 5}, "differs from shape"),
        ({"num_tokens": 5, "shape": [5, 8]}, "frame holds 192 bytes"),
        ({"shape": [6, 9], "num_tokens": 6}, "embedding .frame 1.: frame holds"),
        ({"dtype": "float16"}, "needs 96"),
        ({"deepstack_shapes": [[6, 8]]}, "3 frames, but the message has 4"),
        ({"deepstack_shapes": [[6, 8], [6, 8], [6, 8]]}, "5 frames, but the message has 4"),
        ({"deepstack_shapes": [[6, 8], [6, 7]]}, "deepstack 1 .frame 3."),
        ({"deepstack_shapes": [[6, 8], [6]]}, "deepstack_shapes"),
        ({"deepstack_shapes": None}, "deepstack_shapes"),
        ({"shape": [2**40, 2**40], "num_tokens": 2**40}, "needs"),
    ],
)
def test_decode_rejects_inconsistent_headers(changes, match):
    _, frames = make_frames()
    with pytest.raises(WireError, match=match):
        decode_embedding_message(_with_header(frames, **changes))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "at least 2 frames"),
        ([b"\x81\xa1v\x01"], "at least 2 frames"),
        ([b"\xc1", b""], "not a single msgpack value"),  # 0xc1 is never valid msgpack
        ([b"\x93\x01\x02\x03", b""], "must be a msgpack map"),
        ([msgpack.packb({1: 2}), b""], "not a single msgpack value"),  # strict_map_key
        ([msgpack.packb({"v": 1}) + b"trailing", b""], "not a single msgpack value"),
        ([msgpack.packb(msgpack.ExtType(5, b"x")), b""], "must be a msgpack map"),
        ([msgpack.packb({"v": 1, "pad": "x" * 70000}), b""], "over the 65536-byte limit"),
        ([12345, b""], "bytes-like"),
    ],
)
def test_decode_rejects_garbage(frames, match):
    with pytest.raises(WireError, match=match):
        decode_embedding_message(frames)


class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))  # runs on unpickling


def test_pickle_payload_is_rejected_without_unpickling(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(str(marker)))
    with pytest.raises(WireError):
        decode_embedding_message([payload, b""])
    with pytest.raises(WireError):
        decode_embedding_message([payload])
    _, good = make_frames()
    with pytest.raises(WireError):
        decode_embedding_message([payload, *good[1:]])
    assert not marker.exists()


@settings(max_examples=examples(600), deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_raise_only_wire_error(frames):
    with contextlib.suppress(WireError):
        decode_embedding_message(frames)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=examples(600), deadline=None)
@given(
    st.dictionaries(st.sampled_from(sorted(SPEC_KEYS)), _json), st.lists(st.binary(max_size=64), max_size=3)
)
def test_arbitrary_headers_raise_only_wire_error(header, rest):
    _, good = make_frames()
    base = msgpack.unpackb(good[0], raw=False)
    base.update(header)
    with contextlib.suppress(WireError):
        decode_embedding_message([msgpack.packb(base), *rest])


def test_delivery_fields_round_trip():
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    _, frames = make_frames(traceparent=tp)
    msg = decode_embedding_message(frames)
    assert (msg.message_id, msg.expires_at, msg.traceparent) == ("m-1", 1.9e9, tp)
    _, frames = make_frames()
    assert "traceparent" not in msgpack.unpackb(frames[0], raw=False)  # optional: absent, not null
    assert decode_embedding_message(frames).traceparent is None


def test_fresh_message_ids_are_unique():
    ids = {msgpack.unpackb(make_frames(message_id=None)[1][0], raw=False)["message_id"] for _ in range(100)}
    assert len(ids) == 100


def test_ack_round_trip_and_rejects():
    assert decode_ack(encode_ack("m-7")) == "m-7"
    assert msgpack.unpackb(encode_ack("m-7"), raw=False) == {"v": 3, "ack": "m-7"}
    for bad in (
        msgpack.packb({"v": 2, "ack": "m"}),
        msgpack.packb({"v": 3}),
        msgpack.packb({"v": 3, "ack": 3}),
        b"\xc1",
    ):
        with pytest.raises(WireError):
            decode_ack(bad)


_GROUP = VideoGroupRef(index=1, video_id="cd" * 32, group=2, groups=5, start_s=1.5, end_s=1.75)


def test_a_video_groups_message_carries_its_place_and_round_trips():
    _, frames = make_frames(video=_GROUP)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["video"] == {
        "index": 1, "video_id": "cd" * 32, "group": 2, "groups": 5, "start_s": 1.5, "end_s": 1.75,
    }  # fmt: skip
    assert decode_embedding_message(frames).video == _GROUP
    _, image = make_frames()
    assert "video" not in msgpack.unpackb(image[0], raw=False)
    assert decode_embedding_message(image).video is None


@pytest.mark.parametrize(
    ("video", "match"),
    [
        ({"index": 0}, "exactly"),
        ({**_GROUP.to_header(), "group": 5}, "below video.groups"),
        ({**_GROUP.to_header(), "groups": -1}, "video.groups"),
        ({**_GROUP.to_header(), "video_id": 3}, "video_id"),
        ({**_GROUP.to_header(), "start_s": 2}, "video.start_s"),  # an int, not a float
        ({**_GROUP.to_header(), "end_s": float("nan")}, "video.end_s"),
        ({**_GROUP.to_header(), "start_s": 2.0}, "after video.end_s"),
        ({**_GROUP.to_header(), "extra": 1}, "exactly"),
        ("group 2", "exactly"),
    ],
)
def test_a_malformed_video_map_is_rejected(video, match):
    _, frames = make_frames()
    with pytest.raises(WireError, match=match):
        decode_embedding_message(_with_header(frames, video=video))
