"""A rank's reservation: the override, else the stored one when nothing changed, else the stress."""

from __future__ import annotations

import torch

from vitserve.config import Config
from vitserve.model.base import Encoder
from vitserve.worker.reservation import cache, stress
from vitserve.worker.reservation.cache import PeakWatch
from vitserve.worker.reservation.record import Reservation
from vitserve.worker.reservation.shape import StressShape


def reserve_for_rank(
    cfg: Config,
    shape: StressShape,
    encoder: Encoder,
    device: torch.device,
    rank: int,
    global_rank: int,
    say: stress.Progress,
) -> tuple[Reservation, PeakWatch | None]:
    """The override, else the reservation stored under an equal key, else the stress (then stored). Also
    the PeakWatch the rank loop runs after every batch (None for an override)."""
    if cfg.visual_reserved_mem_gb is not None:
        return stress.override(device, cfg.visual_reserved_mem_gb), None
    key = cache.cache_key(
        weights=encoder.weights_digest,
        model_name=encoder.model_name,
        family=encoder.family,
        dtype=encoder.dtype,
        device=device,
        tp=cfg.tp,
        rank=rank,
        shape=shape,
    )
    path = cache.cache_path(cfg.runtime_dir, device.type, global_rank)
    stored = cache.load(path, key)
    if stress.agree_max(float(stored is None), device) > 0:  # a TP group skips the stress only all together
        stored = None
    if stored is not None:
        say(f"stress: skipped, the reservation stored in {path} matches this setup")
        res = stress.adopt(encoder, stored, str(path))
    else:
        say(f"stress: measuring the worst case at --visual_batch_max_tokens {shape.budget_tokens}")
        res = stress.measure(encoder, shape, progress=say)
        cache.store(path, key, res)
    return res, PeakWatch(device, res.baseline, res.bytes, path)
