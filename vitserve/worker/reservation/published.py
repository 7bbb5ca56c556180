"""The reservation file reserved_mem_<device>_<rank>.json: where it lives, and writing, reading and removing it.

A rank publishes it after its start-up reservation (vitserve/worker/reservation/) and removes it on a clean
exit; the process that spawned the ranks removes the files of ranks it had to kill (remove_killed). An LLM
server on the same device reads it before sizing its KV cache (docs/integration.md).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_FIELDS = {"device": str, "rank": int, "bytes": int, "source": str, "pid": int}
DEVICE_TYPES = ("cpu", "cuda")  # what a rank publishes under: its torch device type


def reservation_path(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> Path:
    safe_device = str(device).replace(os.sep, "_")
    return Path(runtime_dir) / f"reserved_mem_{safe_device}_{int(rank)}.json"


def publish_reservation(
    runtime_dir: str | os.PathLike[str], device: str, rank: int, nbytes: int, source: str
) -> Path:
    """Write the reservation atomically (write_json_atomic)."""
    path = reservation_path(runtime_dir, device, rank)
    body = {
        "device": str(device),
        "rank": int(rank),
        "bytes": int(nbytes),
        "source": source,
        "pid": os.getpid(),
    }
    write_json_atomic(path, body)
    return path


def write_json_atomic(path: Path, body: dict[str, Any]) -> None:
    """A temp file in the same directory, fsync, then os.replace: readers see the old file or the whole new
    one, never a partial write. Creates the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_reservation(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> dict[str, Any] | None:
    """The published reservation, or None when it is not (yet) known. Never raises."""
    try:
        text = reservation_path(runtime_dir, device, rank).read_text()
        body = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    for key, kind in _FIELDS.items():
        value = body.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return None
    return {key: body[key] for key in _FIELDS}


def remove_reservation(runtime_dir: str | os.PathLike[str], device: str, rank: int) -> None:
    """Delete this rank's file on clean shutdown; a missing file is fine."""
    try:
        reservation_path(runtime_dir, device, rank).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove the reservation file: %s", exc)


def remove_killed(runtime_dir: str | os.PathLike[str], ranks: Iterable[int], pids: Collection[int]) -> None:
    """The files of ranks that were killed (a rank removes its own on a clean exit), also of those stopped
    between publishing and their READY: for each global rank, on either device, only a file written by one
    of `pids`, so a file another service published in a shared runtime dir stays."""
    for rank in ranks:
        for device in DEVICE_TYPES:
            body = read_reservation(runtime_dir, device, rank)
            if body is not None and body["pid"] in pids:
                remove_reservation(runtime_dir, device, rank)
