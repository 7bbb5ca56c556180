"""vitserve/checkpoint.py: one reader of a checkpoint's JSON files, the demo, and the weights' content digest
(computed by the loader from the bytes it reads), on tiny real checkpoints written by save_pretrained."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.checkpoints import FAMILIES, make_checkpoint, make_servable_checkpoint
from vitserve.checkpoint import DEMO, Checkpoint, first_size, model_name_of
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES as REGISTRY
from vitserve.model import load_encoder
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.unit
PACKAGE = Path(__file__).resolve().parents[2] / "vitserve"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


# ------------------------------------------------------------------------------------------------ open


@pytest.mark.parametrize("family", FAMILIES)
def test_open_holds_what_the_files_say(checkpoints, family):
    path = checkpoints[family]
    ckpt = Checkpoint.open(str(path))
    config = json.loads((path / "config.json").read_text())
    assert ckpt.config == config
    assert ckpt.processor_config == json.loads((path / "preprocessor_config.json").read_text())
    video = json.loads((path / "video_preprocessor_config.json").read_text())  # make_checkpoint writes one
    assert ckpt.video_processor_config == video
    assert ckpt.family is REGISTRY[family]
    assert (ckpt.path, ckpt.name, ckpt.model_name, ckpt.seed) == (path, str(path), family, None)
    vision = config["vision_config"]
    assert ckpt.geometry.patch_size == first_size(vision["patch_size"])  # InternVL: [14, 14]
    if REGISTRY[family].layout == "patches":
        assert ckpt.geometry.merge_size == vision["spatial_merge_size"]
    # the width every embedding sent to the LLM has: its hidden size (x levels for DeepStack)
    levels = len(vision.get("deepstack_visual_indexes") or []) if REGISTRY[family].deepstack else 0
    assert ckpt.text_hidden_size == config["text_config"]["hidden_size"]
    assert ckpt.llm_embeds_width == ckpt.text_hidden_size * (1 + levels)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_open_reads_the_video_processor_config(tmp_path, family):
    path = make_servable_checkpoint(family, tmp_path / family)
    ckpt = Checkpoint.open(path)
    assert ckpt.video_processor_config == json.loads((path / "video_preprocessor_config.json").read_text())
    # processor_config.json without an image_processor section: preprocessor_config.json is the one HF reads
    assert ckpt.processor_config == json.loads((path / "preprocessor_config.json").read_text())


def test_a_combined_processor_config_wins_as_in_transformers(checkpoints, tmp_path):
    path = shutil.copytree(checkpoints["qwen2_vl"], tmp_path / "ckpt")
    section = {**json.loads((path / "preprocessor_config.json").read_text()), "max_pixels": 12345}
    (path / "processor_config.json").write_text(json.dumps({"image_processor": section}))
    assert Checkpoint.open(path).processor_config == section


def test_open_refuses_what_cannot_be_served(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match=r"^--model '.*nope' is not a directory"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(ConfigError, match="has no config.json"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a JSON object"):
        Checkpoint.open(tmp_path)
    with pytest.raises(
        ConfigError, match=r"--model_family qwen3_vl does not match .* use --model_family qwen2_vl"
    ):
        Checkpoint.open(checkpoints["qwen2_vl"], "qwen3_vl")
    with pytest.raises(ConfigError, match="--model_family 'llava' is not one of"):
        Checkpoint.open(checkpoints["qwen2_vl"], "llava")


def test_a_checkpoint_pickles_for_the_ranks(checkpoints):
    ckpt = Checkpoint.open(checkpoints["internvl"])
    copy = pickle.loads(pickle.dumps(ckpt))
    assert (copy.config, copy.processor_config, copy.family, copy.path) == (
        ckpt.config,
        ckpt.processor_config,
        ckpt.family,
        ckpt.path,
    )


def test_the_model_name_of_a_hub_cache_snapshot_is_its_repo_id(tmp_path):
    snapshot = tmp_path / "models--Qwen--Qwen2.5-VL-7B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert model_name_of(snapshot) == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert model_name_of(tmp_path / "plain-dir") == "plain-dir"


# ------------------------------------------------------------------------------------------------ demo


def test_the_demo_is_a_seeded_checkpoint_without_files():
    demo = Checkpoint.open(DEMO)
    assert (demo.name, demo.path, demo.seed, demo.model_name) == (DEMO, None, 0, DEMO)
    assert demo.family is REGISTRY["qwen2_5_vl"]
    assert (demo.processor_config, demo.text_hidden_size, demo.llm_embeds_width) == (None, None, None)
    assert demo.geometry.patch_size == 14 and demo.geometry.merge_size == 2  # noqa: PT018
    with pytest.raises(ConfigError, match="--model demo is a Qwen2.5-VL tower"):
        Checkpoint.demo("qwen3_vl")
    # the demo's processor is the family's public defaults, and agrees with its tower
    assert load_image_processor(demo).clamp_info() == load_image_processor("qwen2_5_vl").clamp_info()


# ------------------------------------------------------------------------------------------------ digest


def _edit(shard: Path, key_part: str) -> str:
    """Add 1 to the first tensor whose key holds `key_part`; return its key."""
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if key_part in k)
    tensors[key] = tensors[key] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    return key


def test_the_digest_covers_the_vision_tensors_and_the_configs_not_the_path(checkpoints, tmp_path):
    digest = load_encoder(checkpoints["qwen2_5_vl"]).weights_digest
    copy = shutil.copytree(checkpoints["qwen2_5_vl"], tmp_path / "b")
    assert load_encoder(copy).weights_digest == digest  # content, not path
    shard = copy / "model.safetensors"
    save_file(load_file(shard), shard, metadata={"format": "pt"})  # rewritten: other offsets, same tensors
    assert load_encoder(copy).weights_digest == digest
    _edit(shard, "language_model")
    assert load_encoder(copy).weights_digest == digest  # the LLM's weights do not change the encoder
    pre = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**pre, "max_pixels": 99 * 28 * 28}))
    changed_processor = load_encoder(copy).weights_digest
    assert changed_processor != digest  # other pixels for the same bytes
    _edit(shard, "visual.merger")  # e.g. a fine-tuned merger only
    assert load_encoder(copy).weights_digest not in (digest, changed_processor)


def test_the_digest_does_not_depend_on_how_the_weights_are_sharded(tmp_path):
    one = load_encoder(make_checkpoint("qwen2_5_vl", tmp_path / "one")).weights_digest
    sharded = make_checkpoint("qwen2_5_vl", tmp_path / "sharded", sharded=True)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert load_encoder(sharded).weights_digest == one
    other_seed = make_checkpoint("qwen2_5_vl", tmp_path / "seed1", seed=1)
    assert load_encoder(other_seed).weights_digest != one


# ------------------------------------------------------------------------------------------------ one reader


def _string_constants(tree: ast.AST) -> list[str]:
    """String literals that are code, not docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def modules_with_string(predicate) -> list[str]:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if any(predicate(s) for s in _string_constants(ast.parse(file.read_text()))):
            found.append(str(file.relative_to(PACKAGE.parent)))
    return found


def test_config_json_is_named_in_one_module():
    """Opening config.json (or a processor's *config.json) needs its name in the code: only
    vitserve/checkpoint.py has one."""
    assert modules_with_string(lambda s: s.endswith("config.json") and " " not in s) == [
        "vitserve/checkpoint.py"
    ]


def test_the_demo_is_special_cased_in_one_module():
    """No module but vitserve/checkpoint.py compares --model with "demo" (or builds anything from it)."""
    assert modules_with_string(lambda s: s == DEMO) == ["vitserve/checkpoint.py"]


def test_the_scans_above_can_fail(tmp_path):
    tree = ast.parse(
        '"""A docstring naming config.json and demo."""\nif model == "demo":\n    open("config.json")\n'
    )
    assert _string_constants(tree) == ["demo", "config.json"]
