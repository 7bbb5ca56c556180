"""Invariant 8: vitserve's embeddings equal the Hugging Face reference on the same processed pixels.

For every family, both key layouts, sharded and not: the reference is the full model loaded by
transformers' from_pretrained from the same checkpoint directory; vitserve loads only the vision weights.
Each image's rows must equal the reference run on that image alone, whatever it was packed with.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from tests.checkpoints import FAMILIES, VISION_CONFIGS, hf_reference, make_checkpoint
from vitserve.contract import ProcessedImage
from vitserve.model import load_encoder

LAYOUTS = ("model.visual", "visual")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[tuple, object] = {}

    def get(family: str, layout: str = "model.visual", sharded: bool = False):
        key = (family, layout, sharded)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{layout}-{int(sharded)}")
            cache[key] = make_checkpoint(family, path, layout=layout, sharded=sharded)
        return cache[key]

    return get


def image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_process(path, family: str, img: Image.Image) -> ProcessedImage:
    """The HF image processor of the checkpoint itself -> ProcessedImage (independent of vitserve.processors)."""
    proc = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    out = proc(images=[img], return_tensors="pt")
    if family == "internvl":
        vision = VISION_CONFIGS["internvl"]
        side = vision["image_size"][0] // vision["patch_size"][0]
        tiles = out["pixel_values"].shape[0]
        grid = (tiles, side, side)
        tokens = tiles * side * side // 4  # pixel shuffle 0.5
    else:
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        tokens = grid[0] * grid[1] * grid[2] // VISION_CONFIGS[family]["spatial_merge_size"] ** 2
    return ProcessedImage(out["pixel_values"], grid, tokens, img.size, False)


def reference_rows(ref, family: str, item: ProcessedImage):
    grid = None if family == "internvl" else torch.tensor([item.grid_thw])
    return ref(item.pixel_values, grid)


def assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    scale = max(1.0, float(want.abs().max()))
    diff = float((got.float() - want.float()).abs().max())
    assert diff <= 1e-5 * scale, f"max abs diff {diff} (scale {scale})"


# Three batch compositions: one image; several different sizes (different grids, window padding, tiles);
# the same image repeated.
COMPOSITIONS = {
    "single": [(100, 150, 0)],
    "mixed": [(100, 150, 0), (64, 48, 1), (200, 120, 2), (57, 90, 3)],
    "repeated": [(90, 70, 4)] * 3,
}


def check_family(path, family: str, composition: str) -> None:
    ref = hf_reference(path, family)
    enc = load_encoder(str(path))
    items = [hf_process(path, family, image(*spec)) for spec in COMPOSITIONS[composition]]
    outs = enc.encode(items)
    assert len(outs) == len(items)
    for item, out in zip(items, outs, strict=True):
        want, want_deep = reference_rows(ref, family, item)
        assert out.embedding.shape == (item.num_tokens, enc.embed_dim)
        assert_exact(out.embedding, want)
        assert len(out.deepstack) == enc.num_deepstack == len(want_deep)
        for got_layer, want_layer in zip(out.deepstack, want_deep, strict=True):
            assert_exact(got_layer, want_layer)
    # The packed batch also equals HF's own packed forward on the same batch.
    if family != "internvl":
        packed = torch.cat([it.pixel_values for it in items])
        grid = torch.tensor([it.grid_thw for it in items])
        want, _ = ref(packed, grid)
        assert_exact(torch.cat([o.embedding for o in outs]), want)


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_reference(checkpoints, family, composition):
    check_family(checkpoints(family), family, composition)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_reference_every_layout(checkpoints, family, layout, sharded):
    check_family(checkpoints(family, layout, sharded), family, "mixed")


def test_deepstack_only_for_qwen3_vl(checkpoints):
    counts = {family: load_encoder(str(checkpoints(family))).num_deepstack for family in FAMILIES}
    assert counts == {"qwen2_vl": 0, "qwen2_5_vl": 0, "qwen3_vl": 2, "qwen3_5": 0, "internvl": 0}


def test_qwen2_5_batch_exercises_window_attention(checkpoints):
    """Guard on the fixture: the mixed batch must cut images into several windows, or the test proves little."""
    vision = VISION_CONFIGS["qwen2_5_vl"]
    unit = (
        vision["window_size"] // vision["patch_size"] // vision["spatial_merge_size"]
    )  # merged units/window
    path = checkpoints("qwen2_5_vl")
    grids = [hf_process(path, "qwen2_5_vl", image(*s)).grid_thw for s in COMPOSITIONS["mixed"]]
    merged = [(h // 2, w // 2) for _, h, w in grids]
    assert any(h > unit and w > unit for h, w in merged)
    assert any(h % unit or w % unit for h, w in merged)  # a window padded at the edge
    assert set(vision["fullatt_block_indexes"]) < set(range(vision["depth"]))


def test_vitserve_processor_pixels_match_hf_reference(checkpoints):
    """Through vitserve's own processor (once it is on this branch): same pixels, same embeddings."""
    processors = pytest.importorskip("vitserve.processors")
    for family in FAMILIES:
        path = checkpoints(family)
        proc = processors.load_image_processor(str(path), budget_tokens=0)
        ref = hf_reference(path, family)
        enc = load_encoder(str(path))
        items = [proc.preprocess(image(*s)) for s in COMPOSITIONS["mixed"]]
        for item, out in zip(items, enc.encode(items), strict=True):
            want, _ = reference_rows(ref, family, item)
            assert_exact(out.embedding, want)


def test_internvl_earlier_feature_layer(tmp_path):
    """vision_feature_layer != -1 takes hidden_states[layer] (InternVL configs may pick an earlier layer)."""
    path = make_checkpoint("internvl", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["vision_feature_layer"] = -2
    (path / "config.json").write_text(json.dumps(config))
    item = hf_process(path, "internvl", image(100, 150, 0))
    want, _ = reference_rows(hf_reference(path, "internvl"), "internvl", item)
    last_layer, _ = reference_rows(
        hf_reference(make_checkpoint("internvl", tmp_path / "b"), "internvl"), "internvl", item
    )
    assert float((want - last_layer).abs().max()) > 1e-4  # the setting really changes the output
    assert_exact(load_encoder(str(path)).encode([item])[0].embedding, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_hf_bf16(checkpoints, family):
    """In bfloat16 too: bit-identical to the full model from_pretrained(dtype=bfloat16) run on the same packed
    batch (the same operations in the same order, so no round-off allowance is needed)."""
    path = checkpoints(family)
    ref = hf_reference(path, family, dtype=torch.bfloat16)
    enc = load_encoder(str(path), dtype=torch.bfloat16)
    items = [hf_process(path, family, image(*spec)) for spec in COMPOSITIONS["mixed"]]
    outs = enc.encode(items)
    grid = None if family == "internvl" else torch.tensor([it.grid_thw for it in items])
    want, want_deep = ref(torch.cat([it.pixel_values for it in items]), grid)
    got = torch.cat([o.embedding for o in outs])
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    for layer, want_layer in enumerate(want_deep):
        assert torch.equal(torch.cat([o.deepstack[layer] for o in outs]), want_layer)
