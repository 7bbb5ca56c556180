"""The stored reservation (the reservation cache): a rank's measured reservation, kept in --runtime_dir so that a restart with nothing
changed skips the start-up stress (docs/engine.md, "The reservation cache").

One file per rank, reservation_cache_<device>_<global rank>.json, written atomically
(published.write_json_atomic). It holds the key the reservation was measured under and the
result. The key is everything that can change the bytes: the weights, dtype, device model, TP degree and
rank, stress shape (the budget, the batch-image cap and the processor's per-image limits), family, thread count, and the vitserve, torch and transformers versions. A different key means re-measure, with a warning that names what changed.

The weights are keyed by the encoder's `weights_digest`: the checkpoint's content digest
(vitserve/checkpoint.py), which the loader computes from the bytes it reads anyway and which covers the
configs (config.json, the processor configs) that shape the worst case.

When meter.PeakWatch finds the live peak above the published bytes while serving, it deletes the entry
(`invalidate`), so the next start measures again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import vitserve
from vitserve.worker.reservation.budget_model import Record
from vitserve.worker.reservation.published import write_json_atomic
from vitserve.worker.reservation.record import Reservation, StressShape

log = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when the stress or the model changes what a stored number means


def cache_path(runtime_dir: str | os.PathLike[str], device_type: str, global_rank: int) -> Path:
    return Path(runtime_dir) / f"reservation_cache_{device_type.replace(os.sep, '_')}_{int(global_rank)}.json"


def model_path(cache_file: Path) -> Path:
    """--visual_mem_gb's model record (budget_model.Record) beside the stored reservation: every run measured
    and every decision, under the key without the target, so that starts with other targets share it."""
    return cache_file.with_name(cache_file.name.replace("reservation_cache_", "reservation_model_", 1))


def load_model(path: Path, key: dict[str, Any]) -> Record:
    """The model record stored under `key`; an empty one when there is none or it was measured under another
    key (a warning names what changed)."""
    try:
        body = json.loads(path.read_text())
        stored, record = body["key"], Record.from_json(body["record"])
    except FileNotFoundError:
        return Record()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the model record %s is unreadable (%s): measuring again", path, exc)
        return Record()
    if stored != key:
        changed = sorted(k for k in key.keys() | stored.keys() if stored.get(k) != key.get(k))
        log.warning(
            "the model record %s was measured under another setup (%s): measuring again", path, changed
        )
        return Record()
    return record


def store_model(path: Path, key: dict[str, Any], record: Record) -> None:
    try:
        write_json_atomic(path, {"key": key, "record": record.to_json()})
    except OSError as exc:
        log.warning("could not store the model record at %s (%s)", path, exc)


def device_name(device: torch.device) -> str:
    """CUDA: the GPU's name; CPU: the processor model (its kernels and caches shape the RSS growth)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_key(
    *,
    weights: str,
    model_name: str,
    family: str,
    dtype: torch.dtype,
    device: torch.device,
    tp: int,
    rank: int,
    shape: StressShape,
) -> dict[str, Any]:
    """Everything the stored bytes depend on."""
    import transformers

    return {
        "format": CACHE_FORMAT,
        "weights": weights,
        "model_name": model_name,  # what the encoder reports: tells apart encoder factories on one --model
        "family": family,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
        "tp": tp,
        "rank": rank,
        **asdict(
            shape
        ),  # visual_batch_max_tokens, visual_infer_batch_size and the processor's per-image limits
        "vitserve": vitserve.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def load(path: Path, key: dict[str, Any]) -> Reservation | None:
    """The stored reservation when its key equals `key`; else None, with a warning naming what changed."""
    try:
        body = json.loads(path.read_text())
        stored, entry = body["key"], Reservation.from_stored(body["reservation"])
    except FileNotFoundError:
        log.info("no stored reservation at %s: measuring", path)
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the stored reservation %s is unreadable (%s): measuring again", path, exc)
        return None
    if stored != key:
        changed = sorted(k for k in key.keys() | stored.keys() if stored.get(k) != key.get(k))
        what = ", ".join(f"{k} {stored.get(k)!r} -> {key.get(k)!r}" for k in changed)
        log.warning("the stored reservation was measured under another setup (%s): measuring again", what)
        return None
    return entry


def store(path: Path, key: dict[str, Any], res: Reservation) -> None:
    try:
        write_json_atomic(path, {"key": key, "reservation": res.stored()})
    except OSError as exc:  # a read-only runtime dir costs the next start a stress, nothing else
        log.warning("could not store the reservation at %s (%s); the next start measures again", path, exc)


def invalidate(path: Path) -> None:
    """Remove the stored reservation and, beside it, the model record: a live peak above the reservation means
    what was measured under-read, so the next start measures from scratch."""
    for stale in (path, model_path(path)):
        try:
            stale.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove the stored reservation %s: %s", stale, exc)
