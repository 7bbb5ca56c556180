"""One cache entry (an EncodedImage) as bytes for the shared cache: self-describing, versioned, checksummed.

    value = MAGIC (4) | FORMAT_VERSION (u16 LE) | header length (u32 LE) | sha256 (32) | header | payload

header: UTF-8 JSON, {"tensors": [{"dtype": "bfloat16", "shape": [n, d]}, ...]}: the embedding first, then
the deepstack tensors in order; dtype names are the wire's (vitserve/rpc/tensors.py). payload: each
tensor's raw little-endian, C-contiguous bytes, in the same order, nothing between them. The sha256 covers
everything but itself, so a value cut short, a bit flipped, or another program's value under our key is
refused (EntryError) instead of decoded: the caller counts it and treats it as a miss.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct

import torch

from vitserve.contract import EncodedImage
from vitserve.rpc.tensors import DTYPES, dtype_name, tensor_from_buffer, tensor_to_buffer

MAGIC = b"VSCE"  # vitserve cache entry
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST_BYTES = 32
_BODY = _PREFIX.size + _DIGEST_BYTES  # where the header starts


class EntryError(ValueError):
    """A stored value that is not a whole, intact entry of this format."""


def encode_entry(encoded: EncodedImage) -> bytes:
    """The entry as one bytes object (one SET writes it whole: Redis never shows half of it)."""
    tensors = [encoded.embedding, *encoded.deepstack]
    header = json.dumps(
        {"tensors": [{"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for t in tensors]},
        separators=(",", ":"),
    ).encode()
    buffers = [tensor_to_buffer(t) if t.numel() else memoryview(b"") for t in tensors]
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
    digest = hashlib.sha256(prefix)
    parts: list[bytes | memoryview] = [header, *buffers]
    for part in parts:
        digest.update(part)
    return b"".join([prefix, digest.digest(), *parts])


def decode_entry(value: bytes) -> EncodedImage:
    """The EncodedImage a value holds (fresh CPU tensors); EntryError when the value is not intact."""
    view = memoryview(value)
    if len(view) < _BODY:
        raise EntryError(f"entry of {len(view)} bytes is shorter than its fixed prefix ({_BODY} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise EntryError(f"not a vitserve cache entry (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise EntryError(f"entry format v{version}; this build reads v{FORMAT_VERSION}")
    digest = hashlib.sha256(view[: _PREFIX.size])
    digest.update(view[_BODY:])
    if digest.digest() != view[_PREFIX.size : _BODY]:
        raise EntryError("entry checksum mismatch (truncated or corrupted value)")
    header_end = _BODY + header_len
    try:
        specs = json.loads(bytes(view[_BODY:header_end]))["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryError(f"entry header is not readable: {exc}") from None
    tensors = _split(view[header_end:], specs)
    return EncodedImage(embedding=tensors[0], deepstack=tensors[1:])


def _split(payload: memoryview, specs: list[dict[str, object]]) -> list[torch.Tensor]:
    if not isinstance(specs, list) or not specs:
        raise EntryError("entry header names no tensors")
    tensors, offset = [], 0
    for spec in specs:
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if dtype not in DTYPES or not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise EntryError(f"entry header has a bad tensor description: {spec!r}")
        size = math.prod(shape) * DTYPES[str(dtype)].itemsize
        try:
            tensors.append(tensor_from_buffer(payload[offset : offset + size], str(dtype), shape))
        except ValueError as exc:
            raise EntryError(f"entry payload does not match its header: {exc}") from None
        offset += size
    if offset != len(payload):
        raise EntryError(f"entry payload has {len(payload) - offset} bytes beyond its tensors")
    return tensors
