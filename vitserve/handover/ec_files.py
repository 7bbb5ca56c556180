"""The files of the encoder-cache hand-over (--llm_transport ec_storage, docs/vllm.md): their names, how one is
written, and the check of one from its header.

vLLM's file EC connector (ECExampleConnector, an EC consumer) loads `DIR/<uuid>/encoder_cache.safetensors`,
the tensor `ec_cache` of shape (rows, width), for an embedding part that names `uuid`. It joins the uuid onto
DIR unchecked and dies (EngineDeadError) on a missing file or too few rows, so:
- a uuid is vitserve's own: the sha256 hex of what decides the embedding (`ec_uuid`), never `/` or `..`;
- a file is written whole under a temporary name in its directory, then renamed over (`write_file`): vLLM
  memory-maps it on a CPU, so a file is never rewritten in place, only replaced or unlinked;
- before a request names a file, its header says it is there with the rows and width vLLM will assume
  (`check_file`: the 8-byte header length, the JSON header and the file's size; the data is not read).

The header's `__metadata__` keeps what the part sent upstream needs besides the uuid (the grid, a video's
timestamps), so a file left by an earlier run can be reused without decoding its image again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vitserve.errors import VitserveError

FILE_NAME = "encoder_cache.safetensors"
TENSOR = "ec_cache"
UUID_VERSION = "vitserve-ec-1"  # changes whenever what a uuid stands for changes
TEMP_PREFIX = ".vitserve-"  # a temporary file being written, in the uuid's directory
_UUID = re.compile(r"[0-9a-f]{64}")
_HEADER_MAX = 1 << 20  # bytes of JSON header; one tensor's header is ~200 bytes plus the metadata


class EcStorageError(VitserveError):
    """A file the hand-over needs could not be written or read: nothing is sent to the LLM server."""

    status, code = 500, "ec_storage_error"


class EcStorageFull(EcStorageError):
    """The directory's filesystem is full (ENOSPC or a quota)."""

    status, code = 507, "ec_storage_full"


class EcFileMissing(EcStorageError):
    """A file a request names vanished or changed before the request went upstream."""

    status, code = 500, "ec_file_missing"


def ec_uuid(fingerprint: str, kind: str, *ids: str) -> str:
    """The uuid of one item: sha256 hex of the engine's fingerprint (weights digest, budget, resize, dtype,
    versions), the kind ("image", "video") and the item's content ids (an image's bytes' sha256; a video's
    groups' ids, which hold its bytes and sampling)."""
    h = hashlib.sha256(UUID_VERSION.encode())
    for part in (fingerprint, kind, *ids):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def is_uuid(text: str) -> bool:
    """True for a name `ec_uuid` can make (64 lowercase hex digits: no `/`, no `..`)."""
    return _UUID.fullmatch(text) is not None


def file_path(root: Path, uuid: str) -> Path:
    if not is_uuid(uuid):  # never a path of the caller's making
        raise ValueError(f"not an encoder-cache uuid: {uuid!r:.80}")
    return root / uuid / FILE_NAME


@dataclass(frozen=True)
class FileInfo:
    """What a file's header says."""

    rows: int
    width: int
    dtype: str  # safetensors' name: "BF16", "F32", ...
    size: int  # bytes on disk
    metadata: dict[str, str]


def write_file(root: Path, uuid: str, tensor: torch.Tensor, metadata: dict[str, str]) -> FileInfo:
    """Write `tensor` (2-D, any dtype: bf16 stays bf16) as `root/uuid/encoder_cache.safetensors`, atomically:
    a temporary file in the same directory, then os.replace. A full disk is EcStorageFull, any other failure
    EcStorageError; no partial file is left either way."""
    from safetensors.torch import save_file

    path = file_path(root, uuid)
    temp: str | None = None
    try:
        temp = _temp_file(path.parent)
        # save_file writes the tensor's bytes straight to the file: 1.8x faster than save() to bytes and a
        # write at width 16,384 (bench/ec_handover.py), one copy of ~90 MB less per 1080p image
        save_file({TENSOR: tensor.detach().cpu().contiguous()}, temp, metadata=metadata)
        size = os.path.getsize(temp)
        os.replace(temp, path)
        temp = None
    except OSError as exc:
        raise _storage_error(exc, f"writing {path}") from None
    finally:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    rows, width = tensor.shape
    return FileInfo(int(rows), int(width), _dtype_name(tensor.dtype), size, dict(metadata))


def _temp_file(directory: Path) -> str:
    """A new temporary file in `directory`, made if missing. Another replica's sweep may remove the directory
    while it is still empty (handover/ec_store.py): then it is made again."""
    for attempt in range(3):
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
        except FileNotFoundError:
            if attempt == 2:
                raise
            continue
        os.close(fd)
        return temp
    raise AssertionError("unreachable")


def check_file(root: Path, uuid: str, rows: int | None = None, width: int | None = None) -> FileInfo:
    """The file's header, checked: one 2-D `ec_cache` tensor whose data ends where the file does, with
    `rows` and `width` when given. EcFileMissing names what is wrong."""
    path = file_path(root, uuid)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(_HEADER_MAX, size - 8):
                raise EcFileMissing(f"{path}: not a safetensors file")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise EcFileMissing(f"{path} is gone (removed by someone else?); nothing was sent") from None
    except (OSError, ValueError) as exc:
        raise EcFileMissing(f"{path} cannot be read ({exc})") from None
    info = _parse(header, path, size, length)
    if (rows is not None and info.rows != rows) or (width is not None and info.width != width):
        raise EcFileMissing(
            f"{path} holds ({info.rows}, {info.width}), not the ({rows}, {width}) the LLM server will assume"
        )
    return info


def _parse(header: object, path: Path, size: int, length: int) -> FileInfo:
    bad = EcFileMissing(f"{path}: not one whole 2-D {TENSOR!r} tensor")
    entry = header.get(TENSOR) if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(entry, dict):
        raise bad
    try:
        rows, width = (int(n) for n in entry["shape"])
        start, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise bad from None
    metadata = header.get("__metadata__") or {}
    if start != 0 or end != size - 8 - length or not isinstance(metadata, dict):
        raise bad
    return FileInfo(rows, width, str(entry.get("dtype")), size, {str(k): str(v) for k, v in metadata.items()})


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def _storage_error(exc: OSError, doing: str) -> EcStorageError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return EcStorageFull(
            f"{doing}: the --ec_storage_path filesystem is full; lower --ec_storage_gb or give it more room"
        )
    return EcStorageError(f"{doing}: {exc.strerror or exc} (--ec_storage_path)")
