"""The reservation cache in a tensor-parallel group (vitserve/worker/reservation reserve_for_rank): the
ranks run every stress forward together, so they use their stored reservations only all together. With one
rank's entry gone, both measure again; neither waits alone in a collective (that would hang until the
process group's timeout and fail this test)."""

from __future__ import annotations

import os

from tests.checkpoints import make_checkpoint
from tests.dist import run_ranks


def _twice(rank: int, world: int, path: str, runtime_dir: str) -> list[tuple[bool, int]]:
    import torch

    from vitserve.config import Config
    from vitserve.model import load_encoder
    from vitserve.model.tp import apply_tp
    from vitserve.worker.reservation import Method, StressShape, reserve_for_rank
    from vitserve.worker.reservation.stored import cache_path

    enc = load_encoder(path)
    apply_tp(enc.visual, enc.family)
    cfg = Config(
        model=path, tp=world, visual_batch_max_tokens=64, visual_infer_batch_size=4, runtime_dir=runtime_dir
    )
    cpu = torch.device("cpu")
    out = []
    for start in range(3):
        if start == 2 and rank == 1:
            os.unlink(cache_path(runtime_dir, "cpu", rank))  # only this rank lost its entry
        with torch.inference_mode():
            res, _ = reserve_for_rank(cfg, StressShape.of(cfg), enc, cpu, rank, rank, lambda line: None)
        out.append((res.method is Method.STORED, res.bytes))
    return out


def test_a_tp_group_uses_the_stored_reservation_only_when_every_rank_has_it(tmp_path):
    path = str(make_checkpoint("qwen2_vl", tmp_path / "ckpt"))
    results = run_ranks(_twice, 2, path, str(tmp_path / "rt"), timeout_s=60)
    for rank, starts in enumerate(results):
        cached = [c for c, _ in starts]
        assert cached == [False, True, False], f"rank {rank}: {starts}"
        assert starts[1][1] == starts[0][1]  # the stored bytes, as measured
