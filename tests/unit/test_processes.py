"""vitserve/processes/zygote.py: what the ranks' forkserver preloads (the lifecycle e2e tests cover its death)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from vitserve.checkpoint import Checkpoint
from vitserve.errors import ConfigError
from vitserve.processes import zygote


def test_the_guard_comes_first_then_the_rank_and_the_demo_family():
    modules = zygote.preload_modules(Checkpoint.demo())
    assert modules[0] == "vitserve.processes.guard"
    assert "vitserve.worker.process" in modules  # imports vitserve.worker.rank
    assert modules[-1] == "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
    for name in modules:
        assert importlib.util.find_spec(name) is not None, name


def test_a_checkpoint_preloads_its_model_types_modeling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    modules = zygote.preload_modules(Checkpoint.open(tmp_path))
    assert modules[-1] == "transformers.models.qwen3_vl.modeling_qwen3_vl"


def test_an_odd_model_type_adds_no_module(tmp_path):
    """A fine-tune's own model_type (named with --model_family) is not a transformers module path."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "../../etc"}))
    with pytest.raises(ConfigError):  # refused before any forkserver starts
        Checkpoint.open(tmp_path)
    modules = zygote.preload_modules(Checkpoint.open(tmp_path, "qwen3_vl"))
    assert all(not m.startswith("transformers.") for m in modules)
