"""TP sharding equals TP=1 (docs/design.md invariant 8) on real gloo ranks, for every family, on a packed mixed batch.

HF towers built from tiny configs (tests/tp_towers.py) so TP=4 (one head per rank) and InternVL's q/k
RMSNorm are covered; the production path (checkpoint -> load_encoder -> apply_tp) is in test_tp_checkpoints.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tp_towers import FAMILIES, build_visual, packed_inputs, run_visual

CASES = [(f, {}) for f in FAMILIES] + [("internvl", {"qk_norm": False})]  # InternVL with and without qk norm


def _sharded_outputs(rank: int, world: int, cases) -> dict:
    """Per rank: build the same seeded tower, shard it, run the packed batch."""
    from vitserve.errors import ConfigError
    from vitserve.model.tp import apply_tp

    results: dict = {}
    for family, kwargs in cases:
        visual = apply_tp(build_visual(family, **kwargs), family)
        pixels, grid = packed_inputs(family)
        heads = {b.num_heads for b in visual.modules() if hasattr(b, "num_heads") and hasattr(b, "head_dim")}
        results[(family, str(kwargs))] = {"outputs": run_visual(visual, family, pixels, grid), "heads": heads}
    try:
        apply_tp(visual, family)  # the last tower again: sharding shards would be silently wrong
        results["twice"] = "no error"
    except ConfigError as exc:
        results["twice"] = str(exc)
    if world == 4:  # two TP groups of 2 in one world (how dp x tp could be laid out): shard within the group
        import torch.distributed as dist

        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        visual = apply_tp(build_visual("qwen2_5_vl"), "qwen2_5_vl", group=pairs[rank // 2])
        results["pair"] = run_visual(visual, "qwen2_5_vl", *packed_inputs("qwen2_5_vl"))
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    out = {}
    for family, kwargs in CASES:
        pixels, grid = packed_inputs(family)
        out[(family, str(kwargs))] = run_visual(build_visual(family, **kwargs), family, pixels, grid)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tp_equals_tp1_for_every_family(reference, world):
    per_rank = run_ranks(_sharded_outputs, world, CASES, timeout_s=60)
    for rank, results in enumerate(per_rank):
        for key, expected in reference.items():
            got = results[key]
            assert got["heads"] == {4 // world}, (key, rank)  # local head count, read at forward time
            assert len(got["outputs"]) == len(expected)
            for g, e in zip(got["outputs"], expected, strict=True):
                assert g.shape == e.shape
                torch.testing.assert_close(
                    g, e, rtol=0, atol=1e-5, msg=lambda m, k=key, r=rank: f"{k} rank {r}: {m}"
                )
        assert results["twice"].startswith(
            f"apply_tp was already applied to this tower (rank {rank} of {world})"
        )
        if world == 4:
            for g, e in zip(results["pair"], reference[("qwen2_5_vl", "{}")], strict=True):
                torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
