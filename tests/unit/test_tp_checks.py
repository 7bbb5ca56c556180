"""--tp is checked once, from the vision config (preflight.check_tp), naming the numbers, the flag and what
would work; the TP pass finds the blocks it shards and leaves the mergers whole."""

from __future__ import annotations

import pytest

from tests.tp_towers import build_visual
from vitserve import preflight
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES
from vitserve.model.tp import find_blocks

# Qwen2.5-VL-7B's vision widths: 1280 wide, 16 heads, MLP 3420
QWEN25_7B = {"hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen25_real_widths_shard_on_1_2_4(tp):
    preflight.check_tp(tp, FAMILIES["qwen2_5_vl"], QWEN25_7B)


def test_qwen25_mlp_width_not_divisible_by_8_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        preflight.check_tp(8, FAMILIES["qwen2_5_vl"], QWEN25_7B)
    assert str(err.value) == "--tp 8 does not divide the Qwen2.5-VL MLP width (3420); use --tp 1, 2 or 4"


def test_head_count_not_divisible_names_the_heads():
    with pytest.raises(
        ConfigError, match=r"--tp 3 does not divide the Qwen2.5-VL vision attention heads \(16\)"
    ):
        preflight.check_tp(3, FAMILIES["qwen2_5_vl"], QWEN25_7B)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl"])
def test_blocks_are_found_and_mergers_left_whole(family):
    visual = build_visual(family)
    blocks = find_blocks(visual)
    assert len(blocks) == 2  # depth 2; the merger / deepstack mergers / projector are not blocks
