"""The embedding message to the LLM server and its acknowledgement, wire version 3 (docs/wire.md).

One ZMQ multipart message per item of a request, an image or a temporal group of a video (vitserve's DEALER
-> the receiver's ROUTER); v3 added the `video` map of a group's message (v2 carried images only). The header
keeps v2's field names: `image_index` and `num_images` count items, `image_id` is an item's content id:

    frame 0   msgpack map (the header below)
    frame 1   the embedding's raw bytes, little-endian, C-contiguous, (num_tokens, dim) in `dtype`
    frame 2.. one per deepstack tensor, same dtype, shapes in `deepstack_shapes`

and one single-frame acknowledgement back per message the receiver handed to its application:
msgpack {"v": 3, "ack": message_id}. vitserve's vLLM connector (vitserve/connector/glue.py) also reads the
optional header field `uuid` (the vLLM encoder-cache key), may refuse a message (`{"v": 3, "nack": id,
"reason": str}`) and answers a holds query (`{"v": 3, "holds": [uuid, ...], "query_id": str}` ->
`{"v": 3, "held": [...], "query_id": str}`); docs/wire.md, "vitserve's vLLM connector".

Decoding trusts nothing: the header is parsed by msgpack only (never pickle; no ext hooks, string map
keys only, size-capped), every field is type-checked, and every frame size must equal dtype x shape
before a tensor is built over it. Anything else raises WireError, which the receiver logs and skips.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vitserve.rpc.tensors import dtype_name, tensor_from_buffer, tensor_to_buffer

try:
    import msgpack

    def _pack(value: Any) -> bytes:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed

    def _unpack(raw: memoryview) -> Any:
        # msgpack only: no pickle, no ext_hook/object_hook (ext types stay inert ExtType values and
        # fail the type checks), str/bytes map keys only, strings decoded as UTF-8.
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)

except ImportError:  # vLLM's environment: msgspec (a vLLM requirement) reads the same bytes, no msgpack there
    import msgspec

    def _pack(value: Any) -> bytes:
        packed: bytes = msgspec.msgpack.encode(value)
        return packed

    def _unpack(raw: memoryview) -> Any:
        # ext types stay inert msgspec Ext values and fail the type checks; so do non-string map keys
        return msgspec.msgpack.decode(raw)


WIRE_VERSION = 3  # also `vitserve.WIRE_VERSION` (loaded lazily from here)
EMBEDDING_DTYPES = ("float32", "float16", "bfloat16")
MAX_HEADER_BYTES = 64 * 1024  # a real header is ~300 bytes; refuse to msgpack-parse anything huge
MAX_ID_CHARS = 256  # message_id and traceparent (a W3C traceparent is 55 characters)


class WireError(ValueError):
    """A message that does not follow the wire format. The message says what is wrong, never the payload."""


@dataclass(frozen=True)
class VideoGroupRef:
    """Where a temporal group's message sits in its video (the header's `video` map)."""

    index: int  # the video's position among the request's videos, 0-based
    video_id: str  # hex sha256 of the video bytes as received by vitserve
    group: int  # the group's position in the video, 0-based, in time order
    groups: int  # temporal groups in the video
    start_s: float  # time of the group's first frame in the video
    end_s: float  # time of its last frame

    def to_header(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "video_id": self.video_id,
            "group": self.group,
            "groups": self.groups,
            "start_s": float(self.start_s),
            "end_s": float(self.end_s),
        }


@dataclass
class ImageEmbedding:
    """One item's embedding message (an image, or a video's temporal group): the one record the engine
    builds, rpc/wire.py encodes and the LLM server's receiver decodes (docs/integration.md). The field names
    are the wire's (docs/wire.md)."""

    request_id: str  # the /encode request it belongs to
    image_index: int  # the item's place in that request, 0-based: its images, then its videos' groups
    num_images: int  # the request's items (messages); they arrive in image_index order
    image_id: str  # the item's content id: an image's bytes' sha256, a group's cache key (docs/wire.md)
    grid_thw: tuple[int, int, int]  # patch grid before spatial merge
    embedding: torch.Tensor  # (num_tokens, dim)
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each (n, d), Qwen3-VL / Qwen3.5 only
    model: str = ""  # the served model's name
    message_id: str = ""  # unique per message; the acknowledgement names it, duplicates are dropped
    expires_at: float = 0.0  # Unix time (seconds); past it the message is dropped, never returned
    traceparent: str | None = None  # W3C trace context of the /encode request, when it had one
    video: VideoGroupRef | None = None  # a video's temporal group; None for an image
    uuid: str | None = None  # the vLLM encoder-cache key, for vitserve's vLLM connector (is_cache_key)
    num_tokens: int = field(init=False)  # merged tokens = rows of the embedding
    dtype: str = field(init=False)  # "float32" | "float16" | "bfloat16", of embedding and deepstack

    def __post_init__(self) -> None:
        self.num_tokens = int(self.embedding.shape[0]) if self.embedding.dim() else 0
        self.dtype = dtype_name(self.embedding.dtype)


# -- encode -----------------------------------------------------------------------------------------
def encode_embedding_message(message: ImageEmbedding) -> list[bytes | memoryview]:
    """The frames of one wire-format message. Tensor frames are zero-copy views of contiguous CPU tensors:
    the caller must not modify the message's tensors in place until ZMQ has sent them. A message without a
    message_id gets a fresh uuid4 hex (written back into the record)."""
    embedding, deepstack = message.embedding, message.deepstack
    message.message_id = message.message_id or uuid.uuid4().hex
    dtype = _embedding_dtype(embedding, deepstack)
    header: dict[str, Any] = {
        "v": WIRE_VERSION,
        "message_id": message.message_id,
        "expires_at": float(message.expires_at),
        "request_id": message.request_id,
        "image_index": message.image_index,
        "num_images": message.num_images,
        "image_id": message.image_id,
        "model": message.model,
        "grid_thw": [int(x) for x in message.grid_thw],
        "num_tokens": int(embedding.shape[0]),
        "dtype": dtype,
        "shape": list(embedding.shape),
        "deepstack_shapes": [list(d.shape) for d in deepstack],
    }
    if message.traceparent is not None:
        header["traceparent"] = message.traceparent
    if message.video is not None:
        header["video"] = message.video.to_header()
    if message.uuid is not None:
        header["uuid"] = message.uuid
    _check_header(header)  # the sender refuses what a receiver would reject
    frames: list[bytes | memoryview] = [_pack(header)]
    frames.append(tensor_to_buffer(embedding))
    frames.extend(tensor_to_buffer(d) for d in deepstack)
    return frames


def _embedding_dtype(embedding: torch.Tensor, deepstack: Sequence[torch.Tensor]) -> str:
    for t in (embedding, *deepstack):
        if t.dim() != 2:
            raise WireError(f"embedding tensors must be 2-D (tokens, dim), got shape {tuple(t.shape)}")
        if t.dtype != embedding.dtype:
            raise WireError(f"deepstack dtype {t.dtype} differs from the embedding's {embedding.dtype}")
    name = dtype_name(embedding.dtype)
    if name not in EMBEDDING_DTYPES:
        raise WireError(f"embedding dtype {name} is not one of {EMBEDDING_DTYPES}")
    return name


# -- decode -----------------------------------------------------------------------------------------
def decode_embedding_message(frames: Sequence[Any]) -> ImageEmbedding:
    """Parse and check one message (frames as bytes, memoryviews or zmq.Frame objects).

    Tensors share memory with writable frames (zmq.Frame from recv(copy=False)) and copy read-only
    ones (bytes). Raises WireError for anything that is not a well-formed message of this wire version.
    """
    if len(frames) < 2:
        raise WireError(f"a v{WIRE_VERSION} message has at least 2 frames, got {len(frames)}")
    header = _parse_header(_buffer(frames[0]))
    _check_header(header)
    expected_frames = 2 + len(header["deepstack_shapes"])
    if len(frames) != expected_frames:
        raise WireError(
            f"header announces {len(header['deepstack_shapes'])} deepstack tensors, so {expected_frames} "
            f"frames, but the message has {len(frames)}"
        )
    dtype = header["dtype"]
    embedding = _tensor(frames[1], dtype, header["shape"], "embedding (frame 1)")
    deepstack = [
        _tensor(frames[2 + k], dtype, shape, f"deepstack {k} (frame {2 + k})")
        for k, shape in enumerate(header["deepstack_shapes"])
    ]
    return ImageEmbedding(
        request_id=header["request_id"],
        image_index=header["image_index"],
        num_images=header["num_images"],
        image_id=header["image_id"],
        grid_thw=tuple(header["grid_thw"]),
        embedding=embedding,
        deepstack=deepstack,
        model=header["model"],
        message_id=header["message_id"],
        expires_at=header["expires_at"],
        traceparent=header.get("traceparent"),
        video=VideoGroupRef(**header["video"]) if "video" in header else None,
        uuid=header.get("uuid"),
    )


def encode_ack(message_id: str) -> bytes:
    """The one-frame acknowledgement of a message the receiver handed to its application."""
    return _pack({"v": WIRE_VERSION, "ack": message_id})


def decode_ack(frame: Any) -> str:
    """The message id an acknowledgement names; WireError for anything else."""
    ack = _parse_header(_buffer(frame))
    if ack.get("v") != WIRE_VERSION or type(ack.get("v")) is not int:
        raise WireError(f"acknowledgement of unknown wire version {_kind(ack.get('v'))}")
    if not _is_id(ack.get("ack")):
        raise WireError(f"acknowledgement names no message id: {_kind(ack.get('ack'))}")
    return str(ack["ack"])


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame without copying (zmq.Frame exposes .buffer)."""
    buf = getattr(frame, "buffer", frame)
    try:
        return memoryview(buf)
    except TypeError:
        raise WireError(f"a frame must be bytes-like, got {type(frame).__name__}") from None


def _tensor(frame: Any, dtype: str, shape: list[int], what: str) -> torch.Tensor:
    try:
        return tensor_from_buffer(_buffer(frame), dtype, shape)
    except ValueError as exc:
        raise WireError(f"{what}: {exc}") from None


def _parse_header(raw: memoryview) -> dict[str, Any]:  # also parses acknowledgements
    if raw.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {raw.nbytes} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = _unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise WireError(f"header frame is not a single msgpack value ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


_STR_FIELDS = ("request_id", "image_id", "model", "dtype")
_INT_FIELDS = ("image_index", "num_images", "num_tokens")


def _check_header(h: dict[str, Any]) -> None:
    """Every field present, typed, and consistent with the others."""
    version = h.get("v")
    if version != WIRE_VERSION or type(version) is not int:
        raise WireError(f"unknown wire version {_kind(version)}; this receiver speaks v{WIRE_VERSION}")
    _check_delivery(h)
    _check_scalars(h)
    _check_shapes(h)
    if "video" in h:
        _check_video(h["video"])
    if "uuid" in h and not is_cache_key(h["uuid"]):
        raise WireError(f"uuid must be a string of 1-{MAX_ID_CHARS} characters, got {_kind(h['uuid'])}")


def is_cache_key(x: Any) -> bool:
    """A vLLM encoder-cache key: any string of 1-MAX_ID_CHARS characters, as vLLM takes any (vitserve's are 64
    hex characters; vLLM prefixes a LoRA's name with ':'). The connector never uses it as a file name (its
    files are named by the uuid's digest, vitserve/connector/files.py), so '/', '..' or any character is safe."""
    return _is_id(x)


_VIDEO_FIELDS = ("index", "video_id", "group", "groups", "start_s", "end_s")


def _check_video(v: Any) -> None:
    """The v3 `video` map of a temporal group's message."""
    if not isinstance(v, dict) or sorted(v) != sorted(_VIDEO_FIELDS):
        raise WireError(f"video must be a map of exactly {', '.join(_VIDEO_FIELDS)}, got {_kind(v)}")
    if not isinstance(v["video_id"], str):
        raise WireError(f"video.video_id must be a string, got {_kind(v['video_id'])}")
    for name in ("index", "group", "groups"):
        if not _is_count(v[name]):
            raise WireError(f"video.{name} must be a non-negative integer, got {_kind(v[name])}")
    if not v["group"] < v["groups"]:
        raise WireError(f"video.group {v['group']} is not below video.groups {v['groups']}")
    for name in ("start_s", "end_s"):
        if type(v[name]) is not float or not math.isfinite(v[name]) or v[name] < 0:
            raise WireError(f"video.{name} must be a finite float >= 0, got {_kind(v[name])}")
    if v["start_s"] > v["end_s"]:
        raise WireError(f"video.start_s {v['start_s']} is after video.end_s {v['end_s']}")


def _check_delivery(h: dict[str, Any]) -> None:
    """The fields v2 added: message_id, expires_at, and the optional traceparent."""
    if not _is_id(h.get("message_id")):
        raise WireError(f"message_id must be a non-empty string, got {_kind(h.get('message_id'))}")
    expires_at = h.get("expires_at")
    if type(expires_at) is not float or not math.isfinite(expires_at):
        raise WireError(f"expires_at must be a finite float (Unix time), got {_kind(expires_at)}")
    if "traceparent" in h and not _is_id(h["traceparent"]):
        raise WireError(f"traceparent must be a non-empty string, got {_kind(h['traceparent'])}")


def _is_id(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_ID_CHARS


def _check_scalars(h: dict[str, Any]) -> None:
    for name in _STR_FIELDS:
        if not isinstance(h.get(name), str):
            raise WireError(f"field {name!r} must be a string, got {_kind(h.get(name))}")
    for name in _INT_FIELDS:
        if not _is_count(h.get(name)):
            raise WireError(f"field {name!r} must be a non-negative integer, got {_kind(h.get(name))}")
    if not h["image_index"] < h["num_images"]:
        raise WireError(f"image_index {h['image_index']} is not below num_images {h['num_images']}")
    if h["dtype"] not in EMBEDDING_DTYPES:
        raise WireError(f"dtype {_kind(h['dtype'])} is not one of {EMBEDDING_DTYPES}")


def _check_shapes(h: dict[str, Any]) -> None:
    if not _is_dims(h.get("grid_thw"), 3):
        raise WireError(f"grid_thw must be 3 non-negative integers, got {_kind(h.get('grid_thw'))}")
    if not _is_dims(h.get("shape"), 2):
        raise WireError(f"shape must be [num_tokens, dim], got {_kind(h.get('shape'))}")
    if h["shape"][0] != h["num_tokens"]:
        raise WireError(f"num_tokens {h['num_tokens']} differs from shape[0] {h['shape'][0]}")
    shapes = h.get("deepstack_shapes")
    if not isinstance(shapes, list) or not all(_is_dims(s, 2) for s in shapes):
        raise WireError(f"deepstack_shapes must be a list of [n, d], got {_kind(shapes)}")


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0  # bool is an int subclass: refuse it


def _is_dims(x: Any, n: int) -> bool:
    return isinstance(x, list) and len(x) == n and all(_is_count(d) for d in x)


def _kind(x: Any) -> str:
    """A field's type (and value when short) for an error message, never a long payload."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return f"{len(x)} raw bytes"
    text = repr(x)
    return text if len(text) <= 40 else f"a {type(x).__name__} of {len(text)} chars"
