"""The TP pass refuses shapes that do not shard evenly, naming the numbers, the flag and what would work."""

from __future__ import annotations

import pytest
import torch

from tests.tp_towers import _qwen_class, build_visual
from vitserve.errors import ConfigError
from vitserve.model.tp import check_shardable, find_blocks


def _meta_qwen25(**overrides):
    """Qwen2.5-VL-7B's vision widths (1280 wide, 16 heads, MLP 3420), one block, no memory (meta device)."""
    from transformers.models.qwen2_5_vl import Qwen2_5_VLVisionConfig

    cfg = Qwen2_5_VLVisionConfig(depth=1, hidden_size=1280, num_heads=16, intermediate_size=3420, **overrides)
    with torch.device("meta"):
        return _qwen_class("qwen2_5_vl")(cfg)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen25_real_widths_shard_on_1_2_4(tp):
    check_shardable(_meta_qwen25(), "qwen2_5_vl", tp)


def test_qwen25_mlp_width_not_divisible_by_8_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        check_shardable(_meta_qwen25(), "qwen2_5_vl", 8)
    assert str(err.value) == "Qwen2.5-VL MLP width 3420 is not divisible by --tp 8; allowed: 1, 2, 4"


def test_head_count_not_divisible_names_the_heads():
    with pytest.raises(ConfigError, match=r"Qwen2.5-VL vision attention heads 16 is not divisible by --tp 3"):
        check_shardable(_meta_qwen25(), "qwen2_5_vl", 3)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl"])
def test_blocks_are_found_and_mergers_left_whole(family):
    visual = build_visual(family)
    blocks = find_blocks(visual)
    assert len(blocks) == 2  # depth 2; the merger / deepstack mergers / projector are not blocks
    with pytest.raises(ConfigError, match=r"heads 4 is not divisible by --tp 8; allowed: 1, 2, 4"):
        check_shardable(visual, family, 8)
