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


# bf16 comparison: see test_bf16_matches_hf_bf16 for why K is 4.
BF16_ULPS = 4


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (8 significant bits): 2**(e - 7) for 2**e <= |x| < 2**(e + 1)."""
    _, exponent = torch.frexp(x.float().abs())  # |x| = m * 2**exponent, 0.5 <= m < 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def bf16_excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the bf16 ulp at the largest magnitude of its row (tokens x dim)."""
    got, want = got.float(), want.float()
    row_max = torch.maximum(got.abs(), want.abs()).amax(-1, keepdim=True)  # (tokens, 1)
    return float(((got - want).abs() / bf16_ulp(row_max)).max())


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype == torch.bfloat16
    excess = bf16_excess(got, want)
    assert excess <= BF16_ULPS, (
        f"max |diff| is {excess:.2f} bf16 ulps of its row's max magnitude > {BF16_ULPS}"
    )


def encode_bf16_mixed(path, family: str, enc=None):
    """vitserve's and HF's bf16 outputs (embedding and deepstack layers) for the "mixed" batch, packed."""
    enc = enc or load_encoder(str(path), dtype=torch.bfloat16)
    items = [hf_process(path, family, image(*spec)) for spec in COMPOSITIONS["mixed"]]
    outs = enc.encode(items)
    got = [torch.cat([o.embedding for o in outs])]
    got += [torch.cat([o.deepstack[layer] for o in outs]) for layer in range(enc.num_deepstack)]
    grid = None if family == "internvl" else torch.tensor([it.grid_thw for it in items])
    pixels = torch.cat([it.pixel_values for it in items])
    want, want_deep = hf_reference(path, family, dtype=torch.bfloat16)(pixels, grid)
    exact, exact_deep = hf_reference(path, family)(pixels, grid)  # fp32: the round-off-free result
    return got, [want, *want_deep], [exact, *exact_deep]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_hf_bf16(checkpoints, family):
    """In bfloat16: within 4 bf16 ulps (of each row's largest magnitude) of the full model
    from_pretrained(dtype=bfloat16) run on the same packed batch.

    Not bit-identity: that holds only where vitserve and HF run the same kernels, and they do not. The fast
    patch embedding is a matmul where HF runs a Conv3d; without AVX-512 BF16 (this AMD EPYC, older Intel)
    the bf16 Conv3d and Linear go through different CPU kernels, and Qwen3-VL (whose patch embedding has a
    bias) lands one rounding apart on 17 of 2,352 values (measured; with HF's Conv3d kept, 0 differ). The
    packed attention is one batched SDPA where HF loops, and the CPU flash kernel may choose its bf16
    blocking and packing from the batch shape. torch picks these kernels per CPU (oneDNN: AVX-512 / AMX /
    AVX2), so no construction makes the two agree bit for bit on every x86-64 machine.

    The bound. Both sides round to bf16 at the same points (vitserve keeps every HF submodule and dtype) and
    accumulate in fp32 inside every kernel, so a kernel difference flips one rounding: 1 ulp of that
    intermediate. Each block renormalises its residual row (LayerNorm / RMSNorm) and mixes it through
    linear layers, so a flip reaches every element of the row at the row's scale: measured in ulps of the
    row's largest magnitude, not of the element (an element near zero by cancellation carries the row's
    absolute error: the flips above are up to 47 ulps of their own element, at most 1 ulp of their row). Each
    side is within E of the exact result, so they differ by at most 2E. Summing every rounding step's
    half ulp (about 40 steps for qwen3_vl's 3 blocks + merger) gives E <= 20 ulps, a bound that would catch
    nothing; but the steps are independent and each norm shrinks the earlier ones: measured, HF bf16 is
    within 1 ulp of HF fp32 (rounded to bf16) for every family and output. The test allows E up to 2 ulps
    (asserted, so a changed fixture cannot silently outgrow the budget), hence K = 2E = 4.
    test_bf16_comparison_catches_a_wrong_weight shows what it still catches.
    """
    got, want, exact = encode_bf16_mixed(checkpoints(family), family)
    assert len(got) == len(want) == len(exact) == 1 + (2 if family == "qwen3_vl" else 0)
    for got_t, want_t, exact_t in zip(got, want, exact, strict=True):
        assert bf16_excess(want_t, exact_t.to(torch.bfloat16)) <= BF16_ULPS / 2  # E: HF's own bf16 round-off
        assert_bf16_close(got_t, want_t)


# The output projection of each family's merger: a change there reaches the output without being renormalised.
MERGER_OUT = {
    "qwen2_vl": "merger.mlp.2",
    "qwen2_5_vl": "merger.mlp.2",
    "qwen3_vl": "merger.linear_fc2",
    "qwen3_5": "merger.linear_fc2",
    "internvl": "multi_modal_projector.linear_2",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_comparison_catches_a_wrong_weight(checkpoints, family):
    """One weight of vitserve's tower off by 0.05 (2.5 sigma of the checkpoint's weights, below their max
    |w| of about 0.08) makes the bf16 comparison fail: measured 8 (qwen3_vl) to 36 ulps against the bound of 4.

    bf16 cannot resolve everything: the same change inside an early block (qkv) moves the output by about
    1 ulp, inside bf16's own round-off, which is why the fp32 comparisons above hold to 1e-5 of the scale
    (see test_fp32_comparison_catches_a_wrong_weight_deep_in_the_tower).
    """
    path = checkpoints(family)
    enc = load_encoder(str(path), dtype=torch.bfloat16)
    with torch.no_grad():
        enc.visual.get_submodule(MERGER_OUT[family]).weight[0, 0] += 0.05
    got, want, _ = encode_bf16_mixed(path, family, enc)
    with pytest.raises(AssertionError, match="bf16 ulps"):
        assert_bf16_close(got[0], want[0])


def test_fp32_comparison_catches_a_wrong_weight_deep_in_the_tower(checkpoints):
    """fp32 resolves what bf16 cannot: one value-projection weight of the first block off by 0.01 (half the
    weights' sigma) moves the output by 5e-5 of its scale (measured), 5x assert_exact's bound of 1e-5."""
    path = checkpoints("qwen2_5_vl")
    enc = load_encoder(str(path))
    with torch.no_grad():
        enc.visual.get_submodule("blocks.0.attn.qkv").weight[70, 3] += 0.01  # rows 64..95 of qkv are v
    item = hf_process(path, "qwen2_5_vl", image(100, 150, 0))
    want, _ = reference_rows(hf_reference(path, "qwen2_5_vl"), "qwen2_5_vl", item)
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_exact(enc.encode([item])[0].embedding, want)
