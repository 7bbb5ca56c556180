"""The reservation cache: a rank's measured reservation, kept in --runtime_dir so that a restart with nothing
changed skips the start-up stress (docs/engine.md, "Start-up").

One file per rank, reservation_cache_<device>_<global rank>.json, written atomically
(vitserve/reservation_file.write_json_atomic). It holds the key the reservation was measured under and the
result. The key is everything that can change the bytes: the weights, dtype, device model, TP degree and
rank, budget, batch-image cap, family, thread count, and the vitserve, torch and transformers versions. A different key means re-measure, with a warning that names what changed.

The weights are keyed by the encoder's `weights_digest`: the checkpoint's content digest
(vitserve/checkpoint.py), which the loader computes from the bytes it reads anyway and which covers the
configs (config.json, the processor configs) that shape the worst case.

PeakWatch checks after every batch that the live peak stays within the published bytes (CPU: VmHWM growth
over the baseline; CUDA: max_memory_reserved growth); above it, it warns once and deletes the cache entry,
so the next start measures again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import vitserve
from vitserve.config import Config
from vitserve.model.base import Encoder
from vitserve.reservation_file import write_json_atomic
from vitserve.worker import stress

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the stress or the model changes what a stored number means


def cache_path(runtime_dir: str | os.PathLike[str], device_type: str, global_rank: int) -> Path:
    return Path(runtime_dir) / f"reservation_cache_{device_type.replace(os.sep, '_')}_{int(global_rank)}.json"


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
    budget_tokens: int,
    max_batch_images: int,
) -> dict[str, Any]:
    """Everything the stored bytes depend on. The processor's per-image limits that shape the worst case
    (vitserve.worker.stress.stress_shape) follow from the digested processor config, the budget
    and vitserve's version, so computing them (which loads the processor) is left to a miss."""
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
        "budget_tokens": budget_tokens,
        "max_batch_images": max_batch_images,
        "vitserve": vitserve.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@dataclass(frozen=True)
class Entry:
    """A stored reservation: the bytes to publish and how they were found."""

    bytes: int
    method: str
    detail: str
    tokens: int
    images: int


def load(path: Path, key: dict[str, Any]) -> Entry | None:
    """The stored entry when its key equals `key`; else None, with a warning naming what changed."""
    try:
        body = json.loads(path.read_text())
        stored, entry = body["key"], Entry(**body["entry"])
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


def store(path: Path, key: dict[str, Any], entry: Entry) -> None:
    try:
        write_json_atomic(path, {"key": key, "entry": entry.__dict__})
    except OSError as exc:  # a read-only runtime dir costs the next start a stress, nothing else
        log.warning("could not store the reservation at %s (%s); the next start measures again", path, exc)


def invalidate(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove the stored reservation %s: %s", path, exc)


class PeakWatch:
    """After each batch: is the live peak still within the published bytes? Cheap (one /proc read on CPU,
    one allocator counter on CUDA); warns and invalidates the cache entry once, the first time it is not."""

    def __init__(self, device: torch.device, baseline: int, published: int, cache_file: Path | None):
        self.device, self.baseline, self.published, self.cache_file = device, baseline, published, cache_file
        self.exceeded = False

    def check(self) -> None:
        if self.exceeded:
            return
        growth = self._peak() - self.baseline
        if growth <= self.published:
            return
        self.exceeded = True
        log.warning(
            "live memory peak %d bytes above the start-up baseline exceeds the %d bytes reserved; the stored "
            "reservation is dropped so the next start measures again (or set --visual_reserved_mem_gb)",
            growth,
            self.published,
        )
        if self.cache_file is not None:
            invalidate(self.cache_file)

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device))
        hwm = stress.proc_status_kib("VmHWM")
        return 0 if hwm is None else hwm * 1024


def reserve_for_rank(
    cfg: Config,
    encoder: Encoder,
    device: torch.device,
    rank: int,
    global_rank: int,
    say: stress.Progress,
) -> tuple[stress.Reservation, PeakWatch | None]:
    """A rank's reservation: the override, else the stored one when its key matches, else the stress (then
    stored). Also the PeakWatch the rank loop runs after every batch (None for an override)."""
    if cfg.visual_reserved_mem_gb is not None:
        res = stress.reserve(
            encoder, budget_tokens=0, max_batch_images=1, override_gb=cfg.visual_reserved_mem_gb
        )
        return res, None
    key = cache_key(
        weights=encoder.weights_digest,
        model_name=encoder.model_name,
        family=encoder.family,
        dtype=encoder.dtype,
        device=device,
        tp=cfg.tp,
        rank=rank,
        budget_tokens=cfg.budget_tokens,
        max_batch_images=cfg.max_batch_images,
    )
    path = cache_path(cfg.runtime_dir, device.type, global_rank)
    entry = load(path, key)
    if stress.agree_max(float(entry is None), device) > 0:  # a TP group skips the stress only all together
        entry = None
    if entry is not None:
        say(f"stress: skipped, the reservation stored in {path} matches this setup")
        stored = stress.Reservation(
            entry.bytes, "stress", entry.tokens, entry.images, entry.method, entry.detail
        )
        res = stress.adopt(encoder, stored)
    else:
        shape = stress.stress_shape(cfg, encoder.family)  # may load the processor: only on a miss
        say(f"stress: measuring the worst case at --visual_batch_max_tokens {shape.budget_tokens}")
        res = stress.reserve(
            encoder,
            budget_tokens=shape.budget_tokens,
            max_batch_images=shape.max_batch_images,
            override_gb=None,
            max_tiles_per_image=shape.max_tiles_per_image,
            max_image_tokens=shape.max_image_tokens,
            progress=say,
        )
        store(path, key, Entry(res.bytes, res.method, res.detail, res.tokens, res.images))
    return res, PeakWatch(device, res.baseline, res.bytes, path)


def how(res: stress.Reservation) -> str:
    """How a reservation was found, for the progress line."""
    if res.source == "override":
        return "--visual_reserved_mem_gb"
    return f"{res.method}, stored" if res.cached else res.method
