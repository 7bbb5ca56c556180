"""vitserve/families.py: one registry that processors and loader both cover, one tokens-per-tile formula
checked against transformers' own InternVL model, and the start-up refusals it drives."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from tests.checkpoints import FAMILIES as CHECKPOINT_FAMILIES
from tests.checkpoints import make_checkpoint
from vitserve.errors import ConfigError
from vitserve.families import (
    FAMILIES,
    MODEL_TYPES,
    check_geometry,
    family_of_model_type,
    tokens_per_tile,
)
from vitserve.model.adapters import ADAPTERS, resolve_adapter
from vitserve.model.loader import load_encoder
from vitserve.processors import load_image_processor
from vitserve.worker.reservation.worst_case import worst_case_items

pytestmark = pytest.mark.unit


def _checkpoint(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_model_type_resolves_in_processors_and_adapters(tmp_path, model_type):
    family = family_of_model_type(model_type)
    assert model_type in family.model_types
    assert load_image_processor(str(_checkpoint(tmp_path, {"model_type": model_type}))).family == family.name
    assert resolve_adapter(model_type).family == family.name
    assert set(ADAPTERS) == set(MODEL_TYPES)


def test_checkpoint_families_are_the_registry():
    assert set(CHECKPOINT_FAMILIES) == set(FAMILIES)


# --- internvl_chat: refused by the one check, before any rank starts --------------------------------------


@pytest.mark.parametrize("family", ["auto", "internvl"])
def test_internvl_chat_is_refused_by_the_loader_too(family):
    with pytest.raises(ConfigError, match="^--model: model_type 'internvl_chat'"):
        resolve_adapter("internvl_chat", family)


# --- tokens per tile: what transformers' InternVL model really returns ------------------------------------


def _hf_internvl(tile: int, patch: int, ratio: float) -> tf.InternVLModel:
    vision = {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "image_size": [tile, tile],
        "patch_size": [patch, patch],
    }
    text = {
        "model_type": "qwen2",
        "vocab_size": 16,
        "hidden_size": 24,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    config = tf.InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=ratio)
    torch.manual_seed(0)
    return tf.InternVLModel(config).eval()


@pytest.mark.parametrize(
    ("tile", "patch", "ratio"), [(56, 14, 0.5), (112, 14, 0.5), (112, 14, 0.25), (64, 16, 0.5)]
)
def test_tokens_per_tile_is_what_hf_returns(tile, patch, ratio):
    model = _hf_internvl(tile, patch, ratio)
    with torch.inference_mode():
        out = model.get_image_features(pixel_values=torch.randn(2, 3, tile, tile)).pooler_output
    assert out.shape[:2] == (2, tokens_per_tile(tile, patch, ratio))


# side * ratio not whole: the two formulas vitserve used to have disagreed here (round(side^2 r^2) vs
# int(side r)^2); transformers cannot run the model at all, so the geometry is refused up front.
@pytest.mark.parametrize(("tile", "patch", "ratio"), [(42, 14, 0.5), (84, 14, 0.25)])
def test_tile_geometry_hf_cannot_run_is_refused(tile, patch, ratio):
    model = _hf_internvl(tile, patch, ratio)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        model.get_image_features(pixel_values=torch.randn(1, 3, tile, tile))
    with pytest.raises(ConfigError, match="downsample_ratio"):
        tokens_per_tile(tile, patch, ratio)


def test_tile_not_a_multiple_of_the_patch_is_refused():
    with pytest.raises(ConfigError, match="not a multiple of the vision patch 14"):
        tokens_per_tile(50, 14, 0.5)


# --- processor vs tower geometry ---------------------------------------------------------------------------


def test_check_geometry_names_the_mismatch():
    clamp = {"family": "qwen2_vl", "patch_size": 14, "merge_size": 2}
    check_geometry(clamp, {"patch_size": 14, "merge_size": 2})
    check_geometry(clamp, {})  # nothing known about the tower: nothing to compare
    with pytest.raises(
        ConfigError, match="^--model: the Qwen2-VL image processor has patch_size 14 .* has 16"
    ):
        check_geometry(clamp, {"patch_size": 16, "merge_size": 2})


def test_a_checkpoint_whose_processor_and_tower_disagree_is_refused(tmp_path):
    path = make_checkpoint("qwen2_vl", tmp_path / "ckpt")
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "merge_size": 1}))
    with pytest.raises(ConfigError, match="merge_size 1 but the vision tower has 2"):
        load_image_processor(str(path))


# --- the start-up stress batch is one the processor can form ----------------------------------------------


@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_worst_case_tokens_equal_count_tokens(tmp_path, family):
    path = make_checkpoint(family, tmp_path / family)
    budget = 24 if FAMILIES[family].layout == "tiles" else 48
    proc = load_image_processor(str(path), budget)
    encoder = load_encoder(str(path))
    if FAMILIES[family].layout == "patches":
        (item,) = worst_case_items(encoder, budget, 4)
        plan = proc.plan(*item.resized_size)
        assert (plan.num_tokens, plan.grid_thw) == (item.num_tokens, item.grid_thw)
        assert proc.count_tokens(*item.resized_size) == item.num_tokens == budget
        return
    info = proc.clamp_info()
    items = worst_case_items(encoder, budget, 4, max_tiles_per_image=info["max_patches"] + 1)
    tile = info["tile_size"]
    assert all(it.num_tokens == it.grid_thw[0] * info["tokens_per_tile"] for it in items)
    # the largest worst-case image holds as many tokens as the processor's largest image
    assert max(it.num_tokens for it in items) == proc.count_tokens(8 * tile, 8 * tile)
