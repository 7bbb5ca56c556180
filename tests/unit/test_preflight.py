"""vitserve/preflight.py: its refusals, and agreement with the parts that would otherwise fail later (the real
tower's heads and widths the TP pass splits, the image processor's smallest image)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from tests.checkpoints import FAMILIES as CHECKPOINT_FAMILIES
from tests.checkpoints import _config, _preprocessor_config
from tests.tp_towers import build_visual, vision_config
from vitserve import preflight
from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES
from vitserve.model.tp import find_blocks
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.unit


def _json_checkpoint(path, family: str, *, processor: str | None = "preprocessor", weights: bool = True):
    """config.json as save_pretrained writes it for the tiny checkpoint, and (optionally) its processor config."""
    path.mkdir(parents=True, exist_ok=True)
    _config(family).save_pretrained(path)
    if processor == "preprocessor":
        (path / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(family)))
    elif processor == "combined":
        body = {"image_processor": _preprocessor_config(family)}
        (path / "processor_config.json").write_text(json.dumps(body))
    if weights:
        (path / "model.safetensors").write_bytes(b"")  # only its name is looked at
    return path


# --- --tp -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
@pytest.mark.parametrize(("heads", "width", "mlp"), [(4, 32, 48), (6, 48, 96), (2, 16, 40)])
def test_tp_refusals_agree_with_the_tp_pass(family, heads, width, mlp):
    """For every --tp 1..12: preflight refuses exactly when the TP pass on the real tower would."""
    cfg = vision_config(family, heads=heads, width=width, mlp=mlp)
    vision = (cfg.vision_config if family == "internvl" else cfg).to_dict()
    visual = build_visual(family, heads=heads, width=width, mlp=mlp)
    sizes = preflight.shard_sizes(FAMILIES[family], vision)
    assert set(sizes) == {"vision attention heads", "vision width", "MLP width"}
    for tp in range(1, 13):
        shardable = _the_tower_splits(visual, tp)
        assert (tp in preflight.allowed_tp(sizes)) is shardable, tp
        if shardable:
            preflight.check_tp(tp, FAMILIES[family], vision)
        else:
            with pytest.raises(ConfigError, match=rf"^--tp {tp} does not divide .*; use --tp 1"):
                preflight.check_tp(tp, FAMILIES[family], vision)


def _the_tower_splits(visual, tp: int) -> bool:
    """What the TP pass needs of the real module: every block's attention heads and MLP width divide by tp."""
    for block in find_blocks(visual):
        attention = next(block._modules[n] for n in ("attn", "attention") if n in block._modules)
        mlp = block._modules["mlp"]
        widths = [
            getattr(mlp, c).weight.shape[0]
            for c in ("fc1", "gate_proj", "up_proj", "linear_fc1")
            if c in mlp._modules
        ]
        if any(size % tp for size in [int(attention.num_heads), *widths]):
            return False
    return True


def test_tp_refusal_on_the_demo_names_what_works():
    with pytest.raises(ConfigError) as err:
        preflight.check(Config(model="demo", tp=3))
    assert str(err.value) == (
        "--tp 3 does not divide the Qwen2.5-VL vision attention heads (8); use --tp 1, 2, 4 or 8"
    )


# --- the smallest image -----------------------------------------------------------------------------------


@pytest.mark.parametrize("processor", ["preprocessor", "combined", None])
@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_smallest_image_is_what_the_processor_says(tmp_path, family, processor):
    path = _json_checkpoint(tmp_path / "ckpt", family, processor=processor)
    found = preflight.smallest_image(Checkpoint.open(path))
    assert found is not None
    info = load_image_processor(str(path), budget_tokens=0).clamp_info()
    assert found[0] == info.get("tokens_per_tile", info.get("min_tokens"))


def test_smallest_demo_image_is_what_the_processor_says():
    info = load_image_processor("demo", budget_tokens=0).clamp_info()
    with pytest.raises(ConfigError) as err:
        preflight.check(Config(model="demo", visual_batch_max_tokens=info["min_tokens"] - 1))
    assert f"use --visual_batch_max_tokens {info['min_tokens']} or more" in str(err.value)
    preflight.check(Config(model="demo", visual_batch_max_tokens=info["min_tokens"]))
    preflight.check(Config(model="demo", visual_batch_max_tokens=0))  # no budget: nothing to be below


def test_a_budget_below_one_tile_is_refused(tmp_path):
    path = _json_checkpoint(tmp_path / "ckpt", "internvl")  # 56-pixel tiles of 14-pixel patches: 4 tokens
    with pytest.raises(ConfigError) as err:
        preflight.check(Config(model=str(path), visual_batch_max_tokens=3))
    assert str(err.value) == (
        "--visual_batch_max_tokens 3 is below the smallest InternVL image (one 56-pixel tile: 4 tokens); "
        "use --visual_batch_max_tokens 4 or more"
    )


def test_the_processor_backstop_refuses_too():
    info = load_image_processor("qwen3_vl", budget_tokens=10).clamp_info()
    with pytest.raises(ConfigError, match=r"--visual_batch_max_tokens 10 is below .* 64 tokens"):
        preflight.check_processor_budget(10, info)
    preflight.check_processor_budget(64, info)


# --- the checkpoint ---------------------------------------------------------------------------------------


def test_a_checkpoint_without_weights_is_refused(tmp_path):
    path = _json_checkpoint(tmp_path / "ckpt", "qwen2_vl", weights=False)
    with pytest.raises(
        ConfigError, match=r"^--model .* has no weights; give a checkpoint with \*\.safetensors"
    ):
        preflight.check(Config(model=str(path)))
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"has only PyTorch \.bin files \(pytorch_model\.bin\)"):
        preflight.check(Config(model=str(path)))
    (path / "model.safetensors.index.json").write_text("{}")  # shards: the index is enough here
    preflight.check(Config(model=str(path)))


def test_a_checkpoint_without_a_vision_config_is_refused(tmp_path):
    path = _json_checkpoint(tmp_path / "ckpt", "qwen2_5_vl")
    top = json.loads((path / "config.json").read_text())
    del top["vision_config"]
    (path / "config.json").write_text(json.dumps(top))
    with pytest.raises(ConfigError, match=r"^--model .*: config.json has no vision_config"):
        preflight.check(Config(model=str(path)))


def test_a_family_mismatch_names_the_right_family(tmp_path):
    path = _json_checkpoint(tmp_path / "ckpt", "qwen2_5_vl")
    with pytest.raises(ConfigError) as err:
        preflight.check(Config(model=str(path), model_family="qwen3_vl"))
    assert str(err.value) == (
        "--model_family qwen3_vl does not match the checkpoint: config.json's model_type 'qwen2_5_vl' is "
        "a Qwen2.5-VL tower; use --model_family qwen2_5_vl (or auto)"
    )
    preflight.check(Config(model=str(path), model_family="qwen2_5_vl"))


def test_a_fine_tune_with_its_own_model_type_may_name_its_family(tmp_path):
    path = _json_checkpoint(tmp_path / "ckpt", "qwen2_5_vl")
    top = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**top, "model_type": "my_finetune"}))
    with pytest.raises(ConfigError, match=r"unknown model_type 'my_finetune'.*set --model_family"):
        preflight.check(Config(model=str(path)))
    preflight.check(Config(model=str(path), model_family="qwen2_5_vl"))


def test_a_model_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--model '.*missing' is not a directory"):
        preflight.check(Config(model=str(tmp_path / "missing")))


# --- --llm_endpoint ---------------------------------------------------------------------------------------


def test_a_missing_ipc_directory_is_created_private(tmp_path):
    directory = tmp_path / "run" / "vitserve"
    preflight.check_llm_endpoint(f"ipc://{directory}/llm.sock")
    assert directory.is_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    preflight.check_llm_endpoint(f"ipc://{directory}/llm.sock")  # exists: nothing to do
    preflight.check_llm_endpoint("tcp://127.0.0.1:5555")


def test_an_ipc_directory_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--llm_endpoint .*: cannot create its directory .*file/sub"):
        preflight.check_llm_endpoint(f"ipc://{tmp_path}/file/sub/llm.sock")


def test_an_ipc_path_too_long_for_a_unix_socket_is_refused(tmp_path):
    long = os.path.join(str(tmp_path), "d" * 120, "llm.sock")
    with pytest.raises(ConfigError, match=r"above the 107-byte limit of Unix sockets; use a shorter path"):
        preflight.check_llm_endpoint(f"ipc://{long}")


# ------------------------------------------------------------------------------------------------ nodes


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"tp": 3, "nnodes": 2}, ["--tp 3", "--nnodes 2", "use --tp 2, 4"]),
        ({"tp": 2, "nnodes": 2, "dp": 2}, ["--dp 2", "use --dp 1"]),
        ({"tp": 2, "nnodes": 2}, ["--master_addr"]),
        ({"tp": 2, "nnodes": 2, "node_rank": 2, "master_addr": "10.0.0.1"}, ["--node_rank 2", "0..1"]),
        ({"master_port": 65535, "dp": 2}, ["--master_port 65535", "1..65535"]),
    ],
)
def test_impossible_node_layouts_are_refused_naming_the_flag(settings, names):
    with pytest.raises(ConfigError) as err:
        preflight.check(Config(**settings))
    assert all(name in str(err.value) for name in names), str(err.value)


def test_a_possible_node_layout_passes_and_splits_the_ranks():
    config = Config(tp=4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    preflight.check(config)  # the demo tower's heads and widths divide by 4
    assert config.node_ranks == range(2, 4)
    assert Config(tp=4).node_ranks == range(0, 4)


def test_torchrun_environment_gives_the_node_flags():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "GROUP_RANK": "1", "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"}
    assert preflight.torchrun_values(env) == {
        "master_addr": "10.0.0.1",
        "master_port": 29400,
        "node_rank": 1,
        "nnodes": 2,
    }
    # a launch script's NODE_RANK stands for GROUP_RANK; WORLD_SIZE alone (no node rank) is not ours
    assert preflight.torchrun_values({"NODE_RANK": "3", "WORLD_SIZE": "4"}) == {"node_rank": 3, "nnodes": 4}
    assert preflight.torchrun_values({"WORLD_SIZE": "4"}) == {}


def test_torchrun_with_several_processes_per_node_is_refused():
    with pytest.raises(ConfigError, match="--nproc_per_node 1"):
        preflight.torchrun_values({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="GROUP_RANK='x'"):
        preflight.torchrun_values({"GROUP_RANK": "x"})
