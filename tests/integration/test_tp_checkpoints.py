"""Invariant 8 through the production path, for every family: a real tiny checkpoint loaded with
load_encoder (vision weights only, fast kernels on), sharded by apply_tp on 2 gloo ranks, encoding a packed
batch of mixed sizes from vitserve's own processor, equals transformers' from_pretrained vision output.
Each rank then runs the start-up reservation on its sharded encoder (the stress runs the collectives too).
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import FAMILIES, hf_reference, make_checkpoint
from tests.dist import run_ranks
from tests.imagegen import noise
from vitserve.processors import load_image_processor

SIZES = [(100, 60), (56, 56), (90, 130)]  # (w, h): different grids / tile counts in one packed batch


def _encode_sharded(rank: int, world: int, paths: dict, items: dict) -> dict:
    from vitserve.model import load_encoder
    from vitserve.model.tp import apply_tp
    from vitserve.worker.reservation import StressShape
    from vitserve.worker.reservation.stress import measure

    out: dict = {}
    for family, path in paths.items():
        enc = load_encoder(str(path))
        apply_tp(enc.visual, enc.family)
        out[(family, "heads")] = {m.num_heads for m in enc.visual.modules() if hasattr(m, "head_dim")}
        encoded = enc.encode(items[family])
        out[family] = (
            torch.cat([e.embedding for e in encoded]),  # (sum tokens, dim)
            [torch.cat(layer) for layer in zip(*(e.deepstack for e in encoded), strict=True)],
        )
        out[(family, "reserve")] = measure(enc, StressShape(64, 4)).bytes
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    torch.set_num_threads(1)
    paths, items, expected = {}, {}, {}
    for family in FAMILIES:
        path = make_checkpoint(family, tmp_path_factory.mktemp(family))
        proc = load_image_processor(str(path))
        batch = [proc.preprocess(noise(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
        pixels = torch.cat([b.pixel_values for b in batch])
        grid = torch.tensor([b.grid_thw for b in batch])
        paths[family], items[family] = path, batch
        expected[family] = hf_reference(path, family)(pixels, grid)
    return paths, items, expected


def test_tp2_production_encoder_equals_hf(cases):
    paths, items, expected = cases
    assert len({b.num_tokens for b in items["qwen2_5_vl"]}) == len(SIZES)  # really mixed sizes
    for rank, results in enumerate(run_ranks(_encode_sharded, 2, paths, items, timeout_s=60)):
        for family, (want, want_deep) in expected.items():
            got, got_deep = results[family]
            msg = f"{family} rank {rank}"
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m, s=msg: f"{s}: {m}")
            assert len(got_deep) == len(want_deep), msg
            for g, w in zip(got_deep, want_deep, strict=True):
                torch.testing.assert_close(
                    g, w, rtol=0, atol=1e-5, msg=lambda m, s=msg: f"{s} deepstack: {m}"
                )
            assert results[(family, "heads")] == {2}, msg  # 4 heads split over 2 ranks: really sharded
            assert results[(family, "reserve")] > 0, msg
