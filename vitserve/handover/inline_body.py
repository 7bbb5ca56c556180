"""The upstream chat body, with any embeddings inline: tensors spliced in as base64, never through JSON.

An inline embedding part (handover/inline.py) holds an `InlineTensor`, not a string. `dumps_body` (every
transport's body) serializes the rest of the request with a placeholder where each tensor goes, then joins
the JSON pieces with each tensor's base64: the JSON encoder never scans the embeddings (base64's alphabet
needs no escaping inside a JSON string), and the large bytes are copied once, into the body.

The tensor's bytes, as vLLM loads them (its ImageEmbeddingMediaIO / VideoEmbeddingMediaIO):
- a dtype numpy has (float32, float16, ...): `.npy` bytes (no pickle; vLLM recognises numpy's magic and
  loads them with np.load). The header is padded to a multiple of 3 bytes (and of 64, numpy's own
  alignment), so base64(header) + base64(data) is the base64 of the whole file and the data is encoded
  straight from the tensor's memory;
- bfloat16, which numpy lacks: `torch.save` bytes (vLLM loads them with torch.load(weights_only=True)).
  bf16 stays bf16 on the wire: half the bytes of widening it to float32, and the same values (vLLM casts
  to its own dtype either way).

base64 is pybase64's (SIMD, and it releases the GIL while it encodes: the event loop goes on meanwhile,
since this runs on the preprocessing pool).
"""

from __future__ import annotations

import io
import json
import re
import uuid
from typing import Any

import numpy as np
import pybase64
import torch

_NPY_MAGIC = b"\x93NUMPY\x01\x00"  # format version 1.0: a 2-byte header length
_NPY_ALIGN = 192  # the header's length: a multiple of 64 (numpy's alignment) and of 3 (base64's groups)


class InlineTensor:
    """A tensor that goes into the chat body as base64 (`.npy` bytes, or `torch.save` bytes for bf16)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = _compact(tensor.detach().cpu())

    def base64(self) -> list[bytes]:
        """The base64 text, in pieces whose concatenation is the whole (no padding inside)."""
        if self.tensor.dtype == torch.bfloat16:
            buf = io.BytesIO()
            torch.save(self.tensor, buf)
            return [pybase64.b64encode(buf.getbuffer())]
        array = self.tensor.numpy()
        return [pybase64.b64encode(npy_header(array)), pybase64.b64encode(array.data.cast("B"))]

    def raw(self) -> bytes:
        """The decoded bytes (what vLLM gets after base64): for tests and tools, not the hot path."""
        return pybase64.b64decode(b"".join(self.base64()))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """C order, and (for torch.save, which writes a view's whole storage) a storage of exactly its bytes."""
    t = t.contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def npy_header(array: np.ndarray) -> bytes:
    """The `.npy` (version 1.0) header for a C-ordered array, padded with spaces to _NPY_ALIGN bytes."""
    fields = {
        "descr": np.lib.format.dtype_to_descr(array.dtype),
        "fortran_order": False,
        "shape": array.shape,
    }
    text = repr(fields).encode("latin1")
    total = -(-(len(_NPY_MAGIC) + 2 + len(text) + 1) // _NPY_ALIGN) * _NPY_ALIGN
    text += b" " * (total - len(_NPY_MAGIC) - 2 - len(text) - 1) + b"\n"
    return _NPY_MAGIC + len(text).to_bytes(2, "little") + text


def dumps_body(payload: Any) -> bytes:
    """The payload as compact UTF-8 JSON, each InlineTensor as its base64 string."""
    tensors: list[InlineTensor] = []
    nonce = uuid.uuid4().hex  # the client cannot have written it: it did not exist before this call

    def placeholder(obj: object) -> str:
        if not isinstance(obj, InlineTensor):
            raise TypeError(f"{type(obj).__name__} is not JSON serializable")
        tensors.append(obj)
        return f"@{nonce}.{len(tensors) - 1}@"

    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=placeholder).encode()
    if not tensors:
        return text
    pieces = re.split(rb"@" + nonce.encode() + rb"\.(\d+)@", text)
    # re.split with a group: text, index, text, index, ..., text
    if [int(i) for i in pieces[1::2]] != list(range(len(tensors))):
        raise AssertionError("an inline tensor's placeholder is missing or repeated in the body")
    out: list[bytes] = [pieces[0]]
    for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
        out += tensors[int(index)].base64()
        out.append(after)
    return b"".join(out)
