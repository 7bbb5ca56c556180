"""Tensors as raw little-endian, C-contiguous frames plus a small msgpack-able description. No pickle."""

from __future__ import annotations

import math
import sys

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

assert sys.byteorder == "little", (
    "vitserve's wire format is little-endian; big-endian hosts are not supported"
)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire; allowed: {sorted(DTYPES)}") from None


def tensor_to_buffer(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is already contiguous on the CPU."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: view the same bytes as int16
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")  # ndarray.data: a memoryview over the same memory


def tensor_from_buffer(
    buf: bytes | memoryview, dtype: str, shape: list[int] | tuple[int, ...]
) -> torch.Tensor:
    """A tensor over the received bytes; raises ValueError when the size does not match dtype x shape.

    Zero-copy when `buf` is writable (a zmq.Frame's buffer, a bytearray): the tensor shares that memory
    and keeps the buffer alive. A read-only buffer (`bytes`) is copied once, because torch tensors are
    writable and must not alias immutable Python objects.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPES)}")
    if any(type(d) is not int or d < 0 for d in shape):  # bool is an int subclass: refuse it too
        raise ValueError(f"bad shape {shape!r}")
    torch_dtype = DTYPES[dtype]
    # math.prod on Python ints cannot overflow, so a forged huge shape cannot wrap around to a match.
    expected = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    mv = memoryview(buf).cast("B")
    if mv.nbytes != expected:
        raise ValueError(
            f"frame holds {mv.nbytes} bytes but dtype {dtype} x shape {list(shape)} needs {expected}"
        )
    if expected == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    raw = torch.frombuffer(bytearray(mv) if mv.readonly else mv, dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(tuple(shape))
