"""load_encoder: only vision weights are read, errors name the flag to change, the demo tower is sane."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import FAMILIES, make_checkpoint, vision_prefixes
from vitserve.checkpoint import SAFETENSORS_INDEX
from vitserve.contract import ProcessedImage
from vitserve.errors import ConfigError
from vitserve.model import Encoder, load_encoder
from vitserve.model.adapters import ADAPTERS
from vitserve.model.weights import read_vision_weights
from vitserve.worker.reservation import worst_case

pytestmark = pytest.mark.usefixtures("one_thread")


def qwen_item(grid=(1, 4, 6), patch=14, seed=0) -> ProcessedImage:
    """An image of `grid` (1, h, w) patches, as the reservation's stress batches make one."""
    _, h, w = grid
    vision = SimpleNamespace(spatial_merge_size=2, patch_size=patch, temporal_patch_size=2)
    return worst_case.qwen_item(vision, (h // 2, w // 2), seed)


def language_only_shards(path: Path, family: str, layout: str) -> list[Path]:
    weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    prefixes = vision_prefixes(family, layout)
    with_vision = {f for k, f in weight_map.items() if k.startswith(prefixes)}
    return [path / f for f in sorted(set(weight_map.values()) - with_vision)]


# ---- only the vision weights are read -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["model.visual", "visual"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_reads_only_shards_with_vision_weights(tmp_path, family, layout):
    path = make_checkpoint(family, tmp_path / "ckpt", layout=layout, sharded=True)
    language_only = language_only_shards(path, family, layout)
    assert language_only, "fixture must have a shard holding only language weights"
    weights = read_vision_weights(path, ADAPTERS[family].key_prefixes)
    assert len(weights.files_read) > 1  # the tower really is spread over several shards
    assert not set(weights.files_read) & set(language_only)
    # Every tensor read is a vision tensor: one of the module's own keys, nothing of the language model.
    enc = load_encoder(str(path))
    assert set(weights.tensors) == set(enc.visual.state_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_and_encodes_with_language_shards_deleted(tmp_path, family):
    """The strongest form of "never opened": the language-only shards are gone and nothing changes."""
    path = make_checkpoint(family, tmp_path / "ckpt", sharded=True)
    item = _item_for(family)
    before = load_encoder(str(path)).encode([item])[0].embedding
    for shard in language_only_shards(path, family, "model.visual"):
        shard.unlink()
    after = load_encoder(str(path)).encode([item])[0].embedding
    # exact by construction: the same weights, item, kernels and thread count in one process
    assert torch.equal(before, after)


def _item_for(family: str) -> ProcessedImage:
    if family == "internvl":
        pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
        return ProcessedImage(pixels, (2, 4, 4), 8, (56, 112), False)
    return qwen_item(patch=16 if family.startswith("qwen3") else 14)


# ---- what the encoder reports ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_protocol_and_metadata(tmp_path, family):
    path = make_checkpoint(family, tmp_path / "my-checkpoint")
    enc = load_encoder(str(path))
    assert isinstance(enc, Encoder)
    assert enc.family == family
    assert enc.model_name == "my-checkpoint"
    assert enc.embed_dim == 48
    assert enc.dtype == torch.float32
    assert enc.device == torch.device("cpu")
    assert not any(t.is_meta for t in [*enc.visual.parameters(), *enc.visual.buffers()])
    out = enc.encode([_item_for(family)])[0]
    assert out.embedding.shape[1] == 48
    assert torch.isfinite(out.embedding).all()
    assert enc.encode([]) == []


def test_moe_model_type_maps_to_dense_family(tmp_path):
    path = make_checkpoint("qwen3_vl", tmp_path / "ckpt")
    adapter = ADAPTERS["qwen3_vl_moe"]
    assert adapter.family == "qwen3_vl"
    assert ADAPTERS["qwen3_5_moe"].family == "qwen3_5"
    assert load_encoder(str(path), family="qwen3_vl").family == "qwen3_vl"


def test_explicit_family_overrides_unknown_model_type(tmp_path):
    path = make_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    reference = load_encoder(str(path)).encode([qwen_item()])[0].embedding
    config["model_type"] = "my_finetune_vl"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="--model_family"):
        load_encoder(str(path))
    enc = load_encoder(str(path), family="qwen2_5_vl")
    # exact by construction: the same tower and weights on the same item in one process
    assert torch.equal(enc.encode([qwen_item()])[0].embedding, reference)


def test_bf16_load_keeps_rotary_in_fp32(tmp_path):
    path = make_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    enc = load_encoder(str(path), dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    assert {p.dtype for p in enc.visual.parameters()} == {torch.bfloat16}
    assert enc.visual.rotary_pos_emb.inv_freq.dtype == torch.float32
    fp32 = load_encoder(str(path)).encode([qwen_item()])[0].embedding
    bf16 = enc.encode([qwen_item()])[0].embedding
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.float(), fp32, atol=0.1 * float(fp32.abs().max()))


# ---- errors ------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        load_encoder(str(tmp_path / "nope"))


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_encoder(str(tmp_path))


def test_unknown_model_type_names_model_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="--model_family"):
        load_encoder(str(tmp_path))


def test_unknown_family_flag(tmp_path):
    path = make_checkpoint("qwen2_vl", tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="--model_family"):
        load_encoder(str(path), family="llava")


def test_no_safetensors(tmp_path):
    path = make_checkpoint("qwen2_vl", tmp_path / "ckpt")
    for file in path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ConfigError, match="no safetensors"):
        load_encoder(str(path))


def test_checkpoint_without_vision_weights(tmp_path):
    path = make_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if "visual" not in k}, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no vision weights"):
        load_encoder(str(path))


def test_checkpoint_missing_one_vision_tensor(tmp_path):
    path = make_checkpoint("qwen3_vl", tmp_path / "ckpt")
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.visual.merger.linear_fc2.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing merger\.linear_fc2\.weight"):
        load_encoder(str(path))


def test_vision_config_not_matching_weights(tmp_path):
    path = make_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["depth"] = 2  # the file holds 4 blocks
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unexpected blocks.2"):
        load_encoder(str(path))


def test_index_names_a_missing_shard(tmp_path):
    path = make_checkpoint("qwen2_vl", tmp_path / "ckpt", sharded=True)
    weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    (path / weight_map["model.visual.merger.ln_q.weight"]).unlink()
    with pytest.raises(ConfigError, match="missing"):
        load_encoder(str(path))


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int32])
def test_unsupported_dtype_names_flag(dtype):
    with pytest.raises(ConfigError, match="--dtype"):
        load_encoder("demo", dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ConfigError, match="--device"):
        load_encoder("demo", device="cuda")


def test_bad_device_string():
    with pytest.raises(ConfigError, match="--device"):
        load_encoder("demo", device="tpu9")


# ---- demo --------------------------------------------------------------------------------------------


def test_demo_is_seeded_qwen2_5_shaped_and_warns(caplog):
    with caplog.at_level(logging.WARNING):
        enc = load_encoder("demo")
    assert "MEAN NOTHING" in caplog.text
    assert (enc.family, enc.model_name, enc.embed_dim, enc.num_deepstack) == ("qwen2_5_vl", "demo", 1024, 0)
    config = enc.visual.config
    # The "demo" processor is qwen2_5_vl's public defaults: patch 14, merge 2, temporal 2.
    assert (config.patch_size, config.spatial_merge_size, config.temporal_patch_size) == (14, 2, 2)
    assert config.fullatt_block_indexes
    assert len(config.fullatt_block_indexes) < config.depth
    item = qwen_item(grid=(1, 8, 8))
    first = enc.encode([item])[0].embedding
    assert first.shape == (16, 1024)
    assert torch.isfinite(first).all()
    torch.manual_seed(1234)  # the demo weights do not depend on the global RNG
    # exact by construction: seeded weights, the same item, kernels and thread count in one process
    assert torch.equal(load_encoder("demo").encode([item])[0].embedding, first)


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_every_adapter_builds_its_tower_on_meta(model_type):
    """The MoE variants have no tiny checkpoint here; at least their class paths and configs must resolve."""
    adapter = ADAPTERS[model_type]
    config = adapter.config_cls()()
    with torch.device("meta"):
        visual = adapter.build(config)
    assert all(p.is_meta for p in visual.parameters())
    assert adapter.embed_dim(config) > 0
    assert adapter.num_deepstack(config) == (3 if adapter.family == "qwen3_vl" else 0)
