"""A rank's reservation: the override, else the stored one when nothing changed, else the stress; with
--visual_mem_gb, the budget sized to it (sizing.py), or the flag's budget checked against it."""

from __future__ import annotations

import torch

from vitserve.config import Config
from vitserve.model.base import Encoder
from vitserve.worker.reservation import sizing, stored, stress
from vitserve.worker.reservation.meter import PeakWatch
from vitserve.worker.reservation.record import Reservation, StressShape


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
    the PeakWatch the rank loop runs after every batch (None for an override). With --visual_mem_gb alone
    the reservation's budget_tokens is the budget chosen for it."""
    if cfg.visual_reserved_mem_gb is not None:
        return stress.override(device, cfg.visual_reserved_mem_gb), None
    key = stored.cache_key(
        weights=encoder.weights_digest,
        model_name=encoder.model_name,
        family=encoder.family,
        dtype=encoder.dtype,
        device=device,
        tp=cfg.tp,
        rank=rank,
        shape=shape,
    )
    sized = cfg.budget_source == "visual_mem_gb"
    model_key = dict(key)  # the model record's: every target's runs and decisions
    if sized:  # the budget is the result: the key is the target, with the search's bounds
        key["visual_mem_gb"] = cfg.visual_mem_gb
    path = stored.cache_path(cfg.runtime_dir, device.type, global_rank)
    found = stored.load(path, key)
    if stress.agree_max(float(found is None), device) > 0:  # a TP group skips the stress only all together
        found = None
    if found is not None:
        say(f"stress: skipped, the reservation stored in {path} matches this setup")
        res = stress.adopt(encoder, found, str(path))
        if found.sizing is not None:
            say(found.detail)  # why that budget, as the start that chose it said
    elif sized:
        assert cfg.visual_mem_gb is not None
        say(f"stress: sizing the budget for --visual_mem_gb {cfg.visual_mem_gb:g}")
        knobs = sizing.Knobs.of(cfg, encoder, shape)
        record = stored.load_model(stored.model_path(path), model_key)
        try:
            res = sizing.size_for_memory(
                encoder, shape, knobs, lambda: sizing.fresh_meter(device), say, record
            )
        finally:  # refined, never replaced: a failed search's runs are kept too
            stored.store_model(stored.model_path(path), model_key, record)
        stored.store(path, key, res)
    else:
        say(f"stress: measuring the worst case at --visual_batch_max_tokens {shape.visual_batch_max_tokens}")
        res = stress.measure(encoder, shape, progress=say)
        stored.store(path, key, res)
    if cfg.visual_mem_gb is not None and not sized:  # both flags: the flag's budget must fit the target
        sizing.check_fits(sizing.Knobs.of(cfg, encoder, shape), res, shape.visual_batch_max_tokens, device)
    return res, PeakWatch(device, res.baseline, res.bytes, path)
