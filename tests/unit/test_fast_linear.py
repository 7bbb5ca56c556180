"""vitserve.model.fast_linear: linear layers through oneDNN on CPU, equal to F.linear to fp32 round-off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tests.unit.test_fast import assert_close, make_tower
from vitserve.model.fast import optimize
from vitserve.model.fast_linear import (
    linear,
    onednn_linear_ok,
    pack_linear_weights,
    packed_weight,
    use_onednn_linears,
)
from vitserve.model.tp import RowParallelLinear

pytestmark = pytest.mark.skipif(not onednn_linear_ok(), reason="this torch build has no usable oneDNN linear")


@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (5, 7, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=gen), torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    with torch.inference_mode():
        got = linear(x, w, b)
    assert_close(got, F.linear(x, w, b))


def test_autograd_and_other_dtypes_keep_f_linear_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    x, w, b = (
        torch.randn(9, 32, generator=gen),
        torch.randn(16, 32, generator=gen),
        torch.randn(16, generator=gen),
    )
    with torch.no_grad():  # not inference mode: grad mode only is off, so oneDNN is used ...
        assert_close(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # ... and with autograd on, F.linear itself
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    with torch.inference_mode():
        assert torch.equal(linear(xb, wb, bb), F.linear(xb, wb, bb))


def test_only_plain_linears_are_rerouted():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), RowParallelLinear(torch.randn(8, 8), None, None))
    assert use_onednn_linears(model) == 1
    assert "forward" in vars(model[0])
    assert "forward" not in vars(model[2])


def _ops(model: nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> set[str]:
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(pixels, grid_thw)
    return {event.key for event in prof.key_averages()}


def test_the_optimized_tower_runs_no_mkl_linear():
    reference = make_tower("qwen2_5_vl")
    fast = optimize(copy.deepcopy(reference), "qwen2_5_vl")
    grid_thw = torch.tensor([[1, 8, 8]])
    pixels = torch.randn(64, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    assert "aten::addmm" in _ops(reference, pixels, grid_thw)  # HF's linear layers, so the probe can see them
    ops = _ops(fast, pixels, grid_thw)
    assert "mkldnn::_linear_pointwise" in ops
    assert "aten::addmm" not in ops
    assert "aten::linear" not in ops


def test_packed_weights_equal_f_linear_and_follow_a_replaced_weight():
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    use_onednn_linears(model)
    assert pack_linear_weights(model) == 2
    assert pack_linear_weights(model) == 0  # already packed with these very weights
    x = torch.randn(11, 64, generator=gen)
    with torch.inference_mode():
        assert packed_weight(model[0]) is not None
        assert_close(
            model(x), F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        )
        model[1].weight = nn.Parameter(torch.randn(32, 96, generator=gen))  # as the TP pass replaces a shard
        assert packed_weight(model[1]) is None  # the stale copy is never used ...
        assert_close(model[1](model[0](x)), F.linear(model[0](x), model[1].weight, model[1].bias))
    assert pack_linear_weights(model) == 1  # ... and packing again packs only the replaced one


def test_a_packed_tower_equals_hf():
    reference = make_tower("qwen2_5_vl")
    fast = optimize(copy.deepcopy(reference), "qwen2_5_vl")
    assert pack_linear_weights(fast) == sum(isinstance(m, nn.Linear) for m in fast.modules())
    grid_thw = torch.tensor([[1, 8, 8], [1, 4, 6]])
    pixels = torch.randn(88, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert_close(fast(pixels, grid_thw).pooler_output, reference(pixels, grid_thw).pooler_output)
