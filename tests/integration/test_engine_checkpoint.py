"""The engine with the production encoder: a tiny real checkpoint loaded by load_encoder in every rank,
sharded by apply_tp at tp=2, real processor pixels. Embeddings (and deepstack) equal the single-process
encoder's, within fp32 round-off (docs/design.md invariant 8, through the engine)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.checkpoints import make_checkpoint
from tests.integration.engine_helpers import deadline, encode, make_config, running_engine
from vitserve.model import load_encoder
from vitserve.processors import load_image_processor

BUDGET = 128


def _images() -> list[Image.Image]:
    gen = torch.Generator().manual_seed(0)
    sizes = [(224, 224), (112, 336), (300, 140)]
    return [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())
        for w, h in sizes
    ]


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
async def test_tp2_engine_equals_single_process_encoder(tmp_path, family):
    ckpt = make_checkpoint(family, tmp_path / "ckpt")
    proc = load_image_processor(str(ckpt), budget_tokens=BUDGET)
    items = [proc.preprocess(img) for img in _images()]
    reference = load_encoder(str(ckpt), device="cpu", dtype=torch.float32).encode(
        [proc.preprocess(img) for img in _images()]
    )

    config = make_config(tmp_path, model=str(ckpt), tp=2, dtype="float32", visual_batch_max_tokens=BUDGET)
    async with running_engine(config, factory=None) as engine:  # None: the production load_configured_encoder
        assert engine.info().family == family
        results = await encode(
            engine, "ckpt", items, ["a", "b", "c"], deadline=deadline(60), return_embeddings=True
        )
    for ref, res in zip(reference, results, strict=True):
        torch.testing.assert_close(res.embedding, ref.embedding, rtol=1e-4, atol=1e-5)
        assert len(res.deepstack) == len(ref.deepstack)
        assert (len(ref.deepstack) > 0) == (family == "qwen3_vl")
        for d_res, d_ref in zip(res.deepstack, ref.deepstack, strict=True):
            torch.testing.assert_close(d_res, d_ref, rtol=1e-4, atol=1e-5)
