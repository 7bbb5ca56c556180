"""load_image_processor: families, checkpoints read offline, the clamp inside HF, odd sizes (docs/design.md
invariants 1 and 14)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from tests.imagegen import noise
from vitserve.checkpoint import Checkpoint
from vitserve.errors import AspectRatioTooLarge, ConfigError, OverTokenBudget
from vitserve.families import FAMILIES
from vitserve.images import to_rgb
from vitserve.processors import load_image_processor

QWEN = tuple(name for name, family in FAMILIES.items() if family.layout == "patches")


def _write_checkpoint(path, config: dict, preprocessor: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


# --- families and checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "family"),
    [
        ("qwen2_vl", "qwen2_vl"),
        ("qwen2_5_vl", "qwen2_5_vl"),
        ("qwen3_vl", "qwen3_vl"),
        ("qwen3_vl_moe", "qwen3_vl"),
        ("qwen3_5", "qwen3_5"),
        ("qwen3_5_moe", "qwen3_5"),
        ("internvl", "internvl"),
    ],
)
def test_family_of_checkpoint(tmp_path, model_type, family):
    assert Checkpoint.open(_write_checkpoint(tmp_path, {"model_type": model_type})).family.name == family


def test_unknown_model_type_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--model_family"):
        Checkpoint.open(_write_checkpoint(tmp_path, {"model_type": "llava"}))
    with pytest.raises(ConfigError, match="--model"):
        Checkpoint.open(tmp_path / "missing")


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        load_image_processor(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="--visual_batch_max_tokens"):
        load_image_processor("demo", -1)
    with pytest.raises(ConfigError, match="--model_family"):
        load_image_processor("demo", 0, family="llava")


def test_demo_is_qwen2_5_vl_public_defaults():
    proc = load_image_processor("demo")
    assert proc.family == "qwen2_5_vl"
    assert (proc.hf.patch_size, proc.hf.merge_size, proc.hf.temporal_patch_size) == (14, 2, 2)
    assert (proc.hf.size["shortest_edge"], proc.hf.size["longest_edge"]) == (3136, 12845056)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_qwen3_defaults(family):
    proc = load_image_processor(family)
    assert (proc.hf.patch_size, proc.hf.merge_size) == (16, 2)
    assert (proc.hf.size["shortest_edge"], proc.hf.size["longest_edge"]) == (65536, 16777216)
    assert proc.count_tokens(1, 1) == 64  # grown to the 64-token minimum
    assert proc.count_tokens(4096, 4096) == 16384


def test_internvl_defaults():
    proc = load_image_processor("internvl")
    info = proc.clamp_info()
    assert (info["tile_size"], info["tokens_per_tile"], info["max_patches"]) == (448, 256, 12)
    assert proc.count_tokens(448, 448) == 256
    assert proc.count_tokens(896, 448) == 3 * 256  # 2 tiles + thumbnail


def test_checkpoint_preprocessor_config_is_used_and_matches_hf(tmp_path):
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 2 * 784,
        "max_pixels": 300 * 784,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    ckpt = _write_checkpoint(tmp_path, {"model_type": "qwen2_5_vl"}, pre)
    proc = load_image_processor(str(ckpt), resize="pil")
    assert (proc.hf.size["shortest_edge"], proc.hf.size["longest_edge"]) == (2 * 784, 300 * 784)
    ref = AutoImageProcessor.from_pretrained(str(ckpt), backend="pil", local_files_only=True)
    img = noise(500, 333, seed=1)
    out = ref(img, return_tensors="pt")
    item = proc.preprocess(img)
    # exact by construction: vitserve runs HF's own Qwen2VLImageProcessorPil on the same image, same process
    assert torch.equal(item.pixel_values, out["pixel_values"])
    assert list(item.grid_thw) == out["image_grid_thw"][0].tolist()


def test_checkpoint_without_preprocessor_uses_defaults_and_vision_geometry(tmp_path):
    config = {"model_type": "qwen3_vl", "vision_config": {"patch_size": 8, "spatial_merge_size": 2}}
    proc = load_image_processor(str(_write_checkpoint(tmp_path, config)))
    assert proc.family == "qwen3_vl"
    assert (proc.hf.patch_size, proc.hf.size["shortest_edge"]) == (8, 65536)


def test_internvl_without_processor_config_tiles_at_the_tower_size(tmp_path):
    config = {
        "model_type": "internvl",
        "downsample_ratio": 0.5,
        "vision_config": {"patch_size": 14, "image_size": 224},
    }
    proc = load_image_processor(str(_write_checkpoint(tmp_path, config)))
    info = proc.clamp_info()
    assert (info["tile_size"], info["tokens_per_tile"], info["max_patches"]) == (224, 64, 12)
    item = proc.preprocess(noise(448, 224))
    assert item.pixel_values.shape == (3, 3, 224, 224)  # (tiles, C, H, W): 2 tiles + thumbnail
    assert item.grid_thw == (3, 16, 16)
    assert item.num_tokens == 3 * 64


@pytest.mark.parametrize("family", ["auto", "internvl"])
def test_internvl_chat_is_refused_naming_model(tmp_path, family):
    config = {"model_type": "internvl_chat", "vision_config": {"patch_size": 14, "image_size": 224}}
    with pytest.raises(ConfigError, match="^--model: model_type 'internvl_chat'"):
        load_image_processor(str(_write_checkpoint(tmp_path, config)), family=family)


# --- the clamp lives in the HF object -------------------------------------------------------------------


@pytest.mark.parametrize("family", QWEN)
def test_clamp_is_live_inside_hf(family):
    budget = 256
    img = noise(1600, 1200, seed=2)
    unclamped = load_image_processor(family, 0).hf(img, return_tensors="pt")["image_grid_thw"][0]
    proc = load_image_processor(family, budget)
    grid = proc.hf(img, return_tensors="pt")["image_grid_thw"][0]  # HF called directly
    merge = proc.hf.merge_size
    assert int(unclamped.prod()) // merge**2 > budget  # without the clamp HF would go over
    assert int(grid.prod()) // merge**2 <= budget
    assert (
        proc.clamp_info()["max_pixels"] == proc.clamp_info()["longest_edge"] == proc.hf.size["longest_edge"]
    )


def test_internvl_clamp_is_live_inside_hf():
    img = noise(4000, 600, seed=3)
    unclamped = load_image_processor("internvl", 0).hf(img, crop_to_patches=True)["num_patches"][0]
    proc = load_image_processor("internvl", 4 * 256)
    tiles = proc.hf(img, crop_to_patches=True)["num_patches"][0]  # HF called directly
    assert unclamped * 256 > 4 * 256
    assert tiles * 256 <= 4 * 256
    assert proc.clamp_info()["max_patches"] == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_max_tokens_zero_leaves_hf_as_shipped(family):
    assert load_image_processor(family, 0).hf.to_dict() == load_image_processor(family, 0).hf.to_dict()
    assert load_image_processor(family, 0).hf.to_dict() != load_image_processor(family, 300).hf.to_dict()


# --- where HF overshoots --------------------------------------------------------------------------------


def test_shrink_branch_overshoot_is_capped():
    # HF with max_pixels = 4 tokens keeps one 28-pixel row and a long row of 26 groups: 26 tokens.
    h, w = smart_resize(28, 5000, 28, 3136, 4 * 784)
    assert (h // 28) * (w // 28) == 26
    proc = load_image_processor("qwen2_5_vl", 4)
    item = proc.preprocess(noise(5000, 28))
    assert item.num_tokens == proc.count_tokens(5000, 28) == 4
    assert item.grid_thw == (1, 2, 8)
    assert item.pixel_values.shape == (2 * 8, 3 * 2 * 14 * 14)  # (num_patches, C*T*P*P)
    assert item.resized_size == (112, 28)
    assert item.clamped


def test_grow_branch_overshoot_fits_the_minimum():
    # Qwen3-VL grows 300x100 to its 64-token minimum, rounding both sides up: 70 tokens.
    h, w = smart_resize(100, 300, 32, 65536, 64 * 1024)
    assert (h // 32) * (w // 32) == 70
    item = load_image_processor("qwen3_vl", 64).preprocess(noise(300, 100))
    assert item.num_tokens == 64
    assert item.resized_size == (512, 128)  # 16 x 4 groups, the closest aspect ratio at 64 tokens


def test_budget_below_the_processor_minimum_is_over_token_budget():
    proc = load_image_processor("qwen3_vl", 63)
    with pytest.raises(OverTokenBudget, match="--visual_batch_max_tokens") as info:
        proc.count_tokens(300, 100)
    assert "63" in str(info.value)
    with pytest.raises(OverTokenBudget, match="--visual_batch_max_tokens"):
        load_image_processor("internvl", 255).count_tokens(448, 448)


def test_planned_resize_is_the_resize_hf_uses():
    # The non-native path resizes with PIL itself, then lets HF skip resizing: for a size HF would pick
    # anyway, both paths must give identical pixels.
    hf = Qwen2VLImageProcessorPil.from_dict({"min_pixels": 3136, "max_pixels": 12845056})
    img = noise(333, 217, seed=4)
    h, w = smart_resize(217, 333, 28, 3136, 12845056)
    direct = hf(img, return_tensors="pt")["pixel_values"]
    resized = img.resize((w, h), resample=hf.resample)
    assert torch.equal(hf(resized, do_resize=False, return_tensors="pt")["pixel_values"], direct)


# --- odd sizes: a documented error or tokens within the budget (invariants 1 and 14) --------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [(1, 1), (1, 10000), (10000, 1), (332, 27), (27, 332)])
@pytest.mark.parametrize("budget", [8192, 64, 4, 1])
def test_odd_sizes_give_a_documented_error_or_tokens_within_budget(family, size, budget):
    proc = load_image_processor(family, budget)
    width, height = size
    try:
        tokens = proc.count_tokens(width, height)
    except AspectRatioTooLarge:
        assert family != "internvl"
        assert max(size) / min(size) > 200
        return
    except OverTokenBudget:
        minimum = proc.clamp_info().get("min_tokens") or proc.clamp_info()["tokens_per_tile"]
        assert budget < minimum
        return
    assert 1 <= tokens <= budget
    item = proc.preprocess(Image.new("RGB", size, (200, 10, 30)))
    assert item.num_tokens == tokens


@pytest.mark.parametrize("budget", [0, 4])  # 4: 5000x28 takes vitserve's own resize path
def test_non_rgb_input_uses_the_documented_conversion_on_every_path(budget):
    rgba = noise(5000, 28, seed=5, mode="RGBA")
    proc = load_image_processor("qwen2_5_vl", budget)
    from_rgba = proc.preprocess(rgba).pixel_values
    # exact by construction: the same processor on the same RGB pixels (uint8 PIL math, then the same floats)
    assert torch.equal(from_rgba, proc.preprocess(to_rgb(rgba)).pixel_values)
    assert not torch.equal(from_rgba, proc.preprocess(rgba.convert("RGB")).pixel_values)  # alpha matters


def test_combined_processor_config_is_read(tmp_path):
    # newer checkpoints ship only processor_config.json with the image processor nested in it
    nested = {
        "image_processor": {"size": {"shortest_edge": 4096, "longest_edge": 512 * 1024}, "patch_size": 16}
    }
    ckpt = _write_checkpoint(tmp_path, {"model_type": "qwen3_5"})
    (ckpt / "processor_config.json").write_text(json.dumps(nested))
    proc = load_image_processor(str(ckpt), 0)
    assert (proc.hf.size["shortest_edge"], proc.hf.size["longest_edge"]) == (4096, 512 * 1024)
    h, w = smart_resize(4096, 4096, 32, 4096, 512 * 1024)
    assert proc.count_tokens(4096, 4096) == (h // 32) * (w // 32) == 22 * 22
