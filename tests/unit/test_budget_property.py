"""docs/design.md invariant 1 as properties: tokens <= budget or a documented error, for every family.

The pure plan runs over widths/heights 1..20000 and budgets 1..16384 with many examples; the checks that
touch pixels (preprocess, HF identity) use smaller images and fewer examples to stay fast.
"""

from __future__ import annotations

import collections
import functools
import json
from fractions import Fraction

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from tests.imagegen import noise
from tests.profiles import examples
from vitserve.errors import AspectRatioTooLarge, OverTokenBudget
from vitserve.families import FAMILIES
from vitserve.processors import load_image_processor
from vitserve.processors.budget import plan_qwen, plan_tiles, shrink_grid

families = st.sampled_from(list(FAMILIES))
# Uniform draws almost never hit HF's overshoots (thin images, small budgets); mix in small values so
# a good share of examples do.
sides = st.one_of(st.integers(1, 20000), st.integers(1, 120))
budgets = st.one_of(st.integers(1, 16384), st.integers(1, 80))


STATS: collections.Counter = collections.Counter()  # how many examples took vitserve's own resize


@functools.cache
def _proc(family: str, budget: int):
    return load_image_processor(family, budget)


@functools.cache
def _tiles_hf(max_patches: int):
    """The HF tiles object vitserve clamps, one per clamp: every budget with the same max_patches shares it."""
    geo = _proc("internvl", 0).geometry
    budget = next(b for b in range(1, 16385) if geo.clamped_max_patches(b) == max_patches)
    return _proc("internvl", budget).hf


def _hf_tokens(family: str, budget: int, width: int, height: int) -> int:
    """What HF's own counting helper says for the clamped processor; may be over the budget. A Qwen budget
    is the clamped max_pixels, which HF's helper takes as an override (as vLLM calls it): one HF object per
    family serves every budget instead of a new processor per example; test_clamp_is_what_hf_counts_with
    checks that the clamped object holds that very max_pixels."""
    geo = _proc(family, 0).geometry
    if family == "internvl":
        hf = _tiles_hf(geo.clamped_max_patches(budget))
        return hf.get_number_of_image_patches(height, width, {"crop_to_patches": True}) * 256
    hf = _proc(family, 0).hf
    clamp = {"max_pixels": geo.clamped_max_pixels(budget)}
    return hf.get_number_of_image_patches(height, width, clamp) // hf.merge_size**2


def _check_qwen(family: str, width: int, height: int, budget: int) -> None:
    geo = _proc(family, 0).geometry
    aspect = max(width, height) / min(width, height)
    try:
        plan = plan_qwen(width, height, geo, budget)
    except AspectRatioTooLarge:
        assert aspect > 200
        return
    except OverTokenBudget:
        assert budget < geo.min_tokens  # the only documented reason for a Qwen processor
        return
    assert aspect <= 200
    f, m = geo.factor, geo.merge_size
    t, gh, gw = plan.grid_thw
    assert t == 1
    assert 1 <= plan.num_tokens <= budget
    assert plan.num_tokens == gh * gw // (m * m)
    assert plan.resized_size == (gw * geo.patch_size, gh * geo.patch_size)
    assert plan.resized_size[0] % f == 0
    assert plan.resized_size[1] % f == 0
    hf = _hf_tokens(family, budget, width, height)
    if hf <= budget:  # where HF itself stays within the budget, vitserve is HF exactly
        assert plan.hf_native
        assert plan.num_tokens == hf
    nh, nw = smart_resize(height, width, f, geo.min_pixels, geo.max_pixels)
    assert plan.clamped == ((nw, nh) != plan.resized_size)
    STATS["non_native" if not plan.hf_native else "native"] += 1


def _check_tiles(width: int, height: int, budget: int) -> None:
    geo = _proc("internvl", 0).geometry
    try:
        plan = plan_tiles(width, height, geo, budget)
    except OverTokenBudget:
        assert budget < geo.tokens_per_tile
        return
    assert 1 <= plan.num_tokens <= budget
    assert plan.num_tokens == plan.grid_thw[0] * geo.tokens_per_tile
    assert plan.num_tokens == _hf_tokens("internvl", budget, width, height)  # HF's count, clamped object


@settings(max_examples=examples(5000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=families, width=sides, height=sides, budget=budgets)
@example(family="qwen2_5_vl", width=5000, height=28, budget=4)  # shrink-branch overshoot
@example(family="qwen3_vl", width=300, height=100, budget=64)  # grow-branch overshoot
@example(family="qwen3_vl", width=20000, height=100, budget=16384)  # aspect ratio exactly 200
@example(family="qwen2_vl", width=20000, height=99, budget=1)
@example(family="internvl", width=20000, height=1, budget=256)
def test_plan_tokens_within_budget_or_documented_error(family, width, height, budget):
    if family == "internvl":
        _check_tiles(width, height, budget)
    else:
        _check_qwen(family, width, height, budget)


@settings(max_examples=examples(100), deadline=None)
@given(family=st.sampled_from([f for f in FAMILIES if f != "internvl"]), budget=budgets)
def test_clamp_is_what_hf_counts_with(family, budget):
    # the clamped object's own bounds are the override _hf_tokens passes (shortest_edge untouched)
    hf, base = _proc(family, budget).hf, _proc(family, 0).hf
    assert hf.size["longest_edge"] == _proc(family, 0).geometry.clamped_max_pixels(budget)
    assert hf.size["shortest_edge"] == base.size["shortest_edge"]
    assert (hf.patch_size, hf.merge_size) == (base.patch_size, base.merge_size)


@settings(max_examples=examples(800), deadline=None)
@given(family=families, width=sides, height=sides)
def test_no_budget_is_hf_exactly(family, width, height):
    proc = _proc(family, 0)
    try:
        tokens = proc.count_tokens(width, height)
    except AspectRatioTooLarge:
        assert family != "internvl"
        assert max(width, height) / min(width, height) > 200
        return
    assert tokens == _hf_tokens(family, 0, width, height)
    assert not proc.plan(width, height).clamped


@settings(max_examples=examples(100), deadline=None)
@given(family=families, width=st.integers(1, 700), height=st.integers(1, 700), budget=st.integers(1, 2048))
@example(family="qwen2_5_vl", width=600, height=3, budget=4)
@example(family="qwen3_5", width=301, height=100, budget=70)
def test_preprocess_produces_the_counted_grid(family, width, height, budget):
    proc = _proc(family, budget)
    try:
        tokens = proc.count_tokens(width, height)
    except (AspectRatioTooLarge, OverTokenBudget):
        return  # covered by the plan property
    item = proc.preprocess(noise(width, height, seed=width * 7 + height))
    t, gh, gw = item.grid_thw
    assert item.num_tokens == tokens <= budget
    if family == "internvl":
        assert item.pixel_values.shape[0] == t  # (num_tiles, 3, 448, 448)
        assert tokens == t * 256
    else:
        assert item.pixel_values.shape[0] == t * gh * gw  # (num_patches, C*T*P*P)
        assert tokens == t * gh * gw // proc.hf.merge_size**2


@functools.cache
def _reference_hf(family: str, tmp_root: str):
    """An HF processor loaded by HF's own AutoImageProcessor from the family's config, nothing of ours."""
    path = f"{tmp_root}/{family}"
    load_image_processor(family, 0).hf.save_pretrained(path)
    return AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)


@settings(
    max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(family=families, width=st.integers(1, 500), height=st.integers(1, 500))
def test_max_tokens_zero_pixels_identical_to_hf(tmp_path_factory, family, width, height):
    ref = _reference_hf(family, str(tmp_path_factory.getbasetemp()))
    img = noise(width, height, seed=width + 1000 * height)
    kwargs = {"crop_to_patches": True} if family == "internvl" else {}
    try:
        item = load_image_processor(family, 0, resize="pil").preprocess(img)
    except AspectRatioTooLarge:
        assert family != "internvl"
        return
    expected = ref(img, return_tensors="pt", **kwargs)["pixel_values"]
    # exact by construction: budget 0 runs the same HF processor class on the same image in this process
    assert torch.equal(item.pixel_values, expected)


def test_reference_processor_is_really_hf(tmp_path):
    ref = _reference_hf("qwen3_vl", str(tmp_path))
    assert type(ref).__name__ == "Qwen2VLImageProcessorPil"
    assert json.loads((tmp_path / "qwen3_vl" / "preprocessor_config.json").read_text())["patch_size"] == 16


def _best_grid_by_search(width: int, height: int, budget: int, min_tokens: int) -> tuple[int, int]:
    """Spec of the grow-branch fit, by exhaustive search: among grids with min_tokens <= gh*gw <= budget,
    the aspect ratio closest to the image's (exact ratio distance), then the most tokens, then fewest rows."""
    target = Fraction(width, height)
    candidates = [
        (max(Fraction(gw, gh) / target, target / Fraction(gw, gh)), -gh * gw, gh, gw)
        for gh in range(1, budget + 1)
        for gw in range(max(1, -(-min_tokens // gh)), budget // gh + 1)
    ]
    _, _, gh, gw = min(candidates)
    return gh, gw


@settings(max_examples=examples(600), deadline=None)
@given(
    family=st.sampled_from(["qwen2_5_vl", "qwen3_vl"]),
    width=st.integers(1, 400),
    height=st.integers(1, 400),
    extra=st.integers(0, 40),
)
@example(family="qwen3_vl", width=300, height=100, extra=0)
def test_grow_branch_fit_is_the_closest_aspect_grid(family, width, height, extra):
    geo = _proc(family, 0).geometry
    budget = geo.min_tokens + extra
    try:
        plan = plan_qwen(width, height, geo, budget)
    except AspectRatioTooLarge:
        return
    if plan.hf_native:
        return
    f = geo.factor
    rounded = round(height / f) * f * (round(width / f) * f)
    if rounded >= geo.min_pixels:
        return  # shrink branch, checked by the plan property
    gh, gw = _best_grid_by_search(width, height, budget, geo.min_tokens)
    assert plan.resized_size == (gw * f, gh * f)


def test_plan_property_reached_the_overshoot_cases():
    """Guards the strategies above: the plan property must have exercised vitserve's own resize."""
    if not STATS:
        test_plan_tokens_within_budget_or_documented_error()
    assert STATS["non_native"] >= examples(100), STATS  # ~6% of the examples


@given(gh=st.integers(1, 400), gw=st.integers(1, 400), budget=st.integers(1, 16384))
@settings(max_examples=examples(2000))
def test_one_shrink_rule_for_images_and_frames(gh, gw, budget):
    """shrink_grid (images' shrink branch and video frames, video/plan.py) fits the budget, never grows a
    side, keeps what already fits, and where images reach it (HF forced one side to a single patch group)
    caps the other side at the budget: the rule images had before video frames shared it."""
    fh, fw = shrink_grid(gh, gw, budget)
    assert 1 <= fh <= gh
    assert 1 <= fw <= gw
    assert fh * fw <= budget or (fh, fw) == (1, 1)
    if gh * gw <= budget:
        assert (fh, fw) == (gh, gw)
    elif min(gh, gw) == 1:
        assert (fh, fw) == ((1, min(gw, budget)) if gh == 1 else (min(gh, budget), 1))
    elif min(fh, fw) > 1:  # both sides scaled by one factor, then floored: under one token off each side
        error = abs(Fraction(fh * gw, fw * gh) - 1)
        assert error <= Fraction(2, min(fh, fw) - 1)
