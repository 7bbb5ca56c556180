"""The same-host hand-over's messages (docs/wire.md, "One write on one host"): when vitserve and vitserve's vLLM
connector share a host and its shared-memory directory, vitserve writes the tensor itself into the connector's
incoming area and sends its name, size and checksum instead of its bytes:

    vitserve -> connector   {"v": 3, "hello": query_id}
    connector -> vitserve   {"v": 3, "info": query_id, "incoming": dir, "token_file": path, "token": hex,
                             "dtype": str, "width": int, "sample": int}
    vitserve -> connector   {"v": 3, "file": name, "bytes": int, "crc": int, "sample": int, "message_id",
                             "request_id", "uuid", "expires_at", "grid_thw", "rows", "width", "dtype"}
                            -> ack or nack

Each is one msgpack frame. vitserve reads `token_file` and finds `token` in it only when it sees the connector's
very directory (same host, same /dev/shm); it then writes `incoming/<name>`, a name of its own choosing that
matches NAME. `dtype` and `width` are what vLLM serves: vitserve casts to that dtype once, before the wire.

The checksum is sampled (`sampled_crc`): crc32 of `sample` bytes at every STRIDE_BYTES and of the file's last
`sample` bytes, with the size. A full crc32 of 88.5 MB costs ~37 ms on this project's machine (2.4 GB/s), more
than the whole hand-over's target. It is enough for what it guards against: a file vitserve did not finish (on a
recycled file the rest is another tensor's bytes), or a name that points at another tensor (the size, the head,
the tail and one window per MiB, each of which differs between two tensors); it is no defence against a writer
of the same host and uid, which could as well change the file after any check (a process of the same uid can
read and write the connector's memory anyway). One 4 KiB page per MiB (SAMPLE_BYTES) guards as well as 64 KiB
did and costs 0.16 ms a side for 88.5 MB instead of 1.8 (bench/RESULTS.md). A connector's info names the
sample it prefers; a file message names the sample its checksum was summed with, and the connector checks with
that one (either of SAMPLES); a field missing (an older end) means LEGACY_SAMPLE_BYTES, so an older vitserve or
connector still agrees with a newer one.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vitserve.rpc import wire
from vitserve.rpc.tensors import tensor_to_buffer
from vitserve.rpc.wire import WIRE_VERSION, WireError

NAME = re.compile(r"in-[0-9a-f]{32}")  # the only names the connector adopts in its incoming area
SAMPLE_BYTES = 4 << 10
LEGACY_SAMPLE_BYTES = 64 << 10  # what a message or info without `sample` means (before the field existed)
SAMPLES = (SAMPLE_BYTES, LEGACY_SAMPLE_BYTES)  # the only sample sizes a message may name
STRIDE_BYTES = 1 << 20
CHUNK_BYTES = 8 << 20  # rows cast and laid side by side per write: a bounded copy, not the whole tensor


@dataclass(frozen=True)
class Hello:
    query_id: str


@dataclass(frozen=True)
class Info:
    query_id: str
    incoming: str  # the directory vitserve writes into
    token_file: str  # a file only a process that sees the connector's directory can read
    token: str  # what it holds
    dtype: str  # the dtype vLLM serves ("" when unknown): vitserve casts to it before the wire
    width: int  # the row width vLLM's model needs (0: unchecked)
    sample: int = LEGACY_SAMPLE_BYTES  # the checksum's sample this connector prefers (an older one: LEGACY)


@dataclass(frozen=True)
class FileEmbedding:
    """An embedding vitserve wrote into the connector's incoming area; field names as the embedding message's."""

    name: str  # the file's name in the incoming area (NAME)
    nbytes: int  # its size: rows x width x the dtype's size
    crc: int  # sampled_crc of its bytes
    message_id: str
    request_id: str
    uuid: str
    expires_at: float
    grid_thw: tuple[int, int, int]
    rows: int
    width: int  # main columns and DeepStack levels side by side
    dtype: str
    sample: int = LEGACY_SAMPLE_BYTES  # the checksum's sample (sampled_crc)
    recycled: bool = False  # not on the wire: vitserve wrote over a pool file (connector/pool.py)


def encode_hello(query_id: str) -> bytes:
    return wire._pack({"v": WIRE_VERSION, "hello": query_id})


def encode_info(info: Info) -> bytes:
    fields = {k: getattr(info, k) for k in ("incoming", "token_file", "token", "dtype", "width", "sample")}
    return wire._pack({"v": WIRE_VERSION, "info": info.query_id, **fields})


def encode_file(f: FileEmbedding) -> bytes:
    header = {
        "v": WIRE_VERSION,
        "file": f.name,
        "bytes": f.nbytes,
        "crc": f.crc,
        "sample": f.sample,
        "grid_thw": list(f.grid_thw),
    }
    for k in ("message_id", "request_id", "uuid", "expires_at", "rows", "width", "dtype"):
        header[k] = getattr(f, k)
    _check_file(header)  # the sender refuses what the connector would reject
    return wire._pack(header)


def decode_handoff(frames: Sequence[Any]) -> Hello | FileEmbedding | None:
    """A hello or a file message; None for anything else (the other messages' decoder takes it). WireError for a
    hello or file message that is malformed."""
    if len(frames) != 1:
        return None
    try:
        message = wire._parse_header(wire._buffer(frames[0]))
    except WireError:
        return None
    if "hello" in message:
        return Hello(_string(message, "hello"))
    if "file" not in message:
        return None
    _check_file(message)
    fields = {
        k: message[k] for k in ("message_id", "request_id", "uuid", "expires_at", "rows", "width", "dtype")
    }
    return FileEmbedding(message["file"], message["bytes"], message["crc"], **fields,
                         grid_thw=tuple(message["grid_thw"]), sample=_sample(message))  # fmt: skip


def decode_info(frame: Any) -> Info:
    message = wire._parse_header(wire._buffer(frame))
    if message.get("v") != WIRE_VERSION or "info" not in message:
        raise WireError(f"not an info answer: keys {sorted(message)[:8]}")
    width = message.get("width")
    if not wire._is_count(width):
        raise WireError(f"info: width must be a non-negative integer, got {wire._kind(width)}")
    incoming, token_file, token, dtype = (
        _string(message, k, empty=True) for k in ("incoming", "token_file", "token", "dtype")
    )
    return Info(
        _string(message, "info"), incoming, token_file, token, dtype, int(width or 0), _sample(message)
    )


def _sample(message: dict[str, Any]) -> int:
    sample = message.get("sample", LEGACY_SAMPLE_BYTES)
    if sample not in SAMPLES or type(sample) is not int:
        raise WireError(f"sample must be one of {list(SAMPLES)}, got {wire._kind(sample)}")
    return int(sample)


def _check_file(h: dict[str, Any]) -> None:
    if h.get("v") != WIRE_VERSION or type(h.get("v")) is not int:
        raise WireError(f"unknown wire version {wire._kind(h.get('v'))}; this end speaks v{WIRE_VERSION}")
    for k in ("file", "message_id", "request_id", "uuid", "dtype"):
        _string(h, k)
    for k in ("bytes", "crc", "rows", "width"):
        if not wire._is_count(h.get(k)):
            raise WireError(f"{k} must be a non-negative integer, got {wire._kind(h.get(k))}")
    if type(h.get("expires_at")) is not float:
        raise WireError(f"expires_at must be a float (Unix time), got {wire._kind(h.get('expires_at'))}")
    if not wire._is_dims(h.get("grid_thw"), 3):
        raise WireError(f"grid_thw must be 3 non-negative integers, got {wire._kind(h.get('grid_thw'))}")
    _sample(h)
    if h["dtype"] not in wire.EMBEDDING_DTYPES:
        raise WireError(f"dtype {wire._kind(h['dtype'])} is not one of {wire.EMBEDDING_DTYPES}")


def _string(message: dict[str, Any], name: str, *, empty: bool = False) -> str:
    value = message.get(name)
    if not (isinstance(value, str) and (empty or value) and len(value) <= 4096):
        raise WireError(f"{name} must be a string, got {wire._kind(value)}")
    return value


def sampled_crc(fd: int, nbytes: int, sample: int = SAMPLE_BYTES) -> int:
    """crc32 of the size, of `sample` bytes at every STRIDE_BYTES and of the last `sample` bytes of the open
    file."""
    crc = zlib.crc32(nbytes.to_bytes(8, "little"))
    offsets = [*range(0, max(nbytes - sample, 0), STRIDE_BYTES), max(nbytes - sample, 0)]
    for offset in offsets:
        crc = zlib.crc32(os.pread(fd, sample, offset), crc)
    return crc


def write_rows(fd: int, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
    """Write (rows, sum of widths) in `dtype` to the open file: each row the main row then every DeepStack
    level's, cast on the way into one reused chunk buffer (one pass over the bytes, no allocation per chunk: a
    fresh 8 MiB tensor per chunk costs its page faults). Returns the bytes written."""
    rows = int(parts[0].shape[0])
    widths = [int(p.shape[1]) for p in parts]
    if len(parts) == 1 and parts[0].dtype == dtype:
        return _write_all(fd, tensor_to_buffer(parts[0]))  # the tensor's own bytes, no copy
    step = max(1, CHUNK_BYTES // max(1, sum(widths) * torch.empty((), dtype=dtype).element_size()))
    chunk = torch.empty(min(step, rows), sum(widths), dtype=dtype)  # (step, width)
    done = 0
    for start in range(0, rows, step):
        n = min(step, rows - start)
        place_side_by_side(chunk[:n], [part[start : start + n] for part in parts])
        done += _write_all(fd, tensor_to_buffer(chunk[:n]))
    return done


def place_side_by_side(dest: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copy (and cast) each part into `dest`'s next columns: (rows, sum of widths), each row the main row then
    every DeepStack level's (the file layout of docs/wire.md)."""
    column = 0
    for part in parts:
        width = int(part.shape[1])
        dest[:, column : column + width].copy_(part)
        column += width


def _write_all(fd: int, view: memoryview) -> int:
    total = view.nbytes
    while view.nbytes:
        view = view[os.write(fd, view) :]
    return total
