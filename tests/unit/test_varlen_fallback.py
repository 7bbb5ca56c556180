"""The varlen attention's run-time fallback (vitserve/model/fast_varlen.py), on the CPU.

A kernel the probe accepted but that raises on a real call is dropped with a WARNING naming what serves
instead, and the call still returns the right rows. On the CPU the real flash op raises (no CPU kernel), so
it plays the failing kernel; SDPA per segment (the module's own reference) plays the next one.
"""

from __future__ import annotations

import logging

import torch

from vitserve.model import fast_varlen
from vitserve.model.fast_varlen import (
    GROUPED,
    first_that_runs,
    kernels_ran,
    reference_attention,
    reset_kernels_ran,
)


def _per_segment(q, k, v, cu, max_len, scale):
    return reference_attention(q, k, v, cu.tolist(), scale)


def _strided_qkv(rows: int, heads: int, head_dim: int):
    """q, k, v as a real call passes them: views of (N, 2, H, D) and (N, 3, H, D) tensors."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, 3, heads, head_dim, generator=gen)
    qk = qkv[:, :2].clone()
    return qk[:, 0], qk[:, 1], qkv[:, 2]


def test_a_kernel_that_fails_at_run_time_falls_back_and_says_so(caplog):
    q, k, v = _strided_qkv(30, 2, 72)  # Qwen3-VL-8B's head_dim
    bounds = [0, 10, 10, 30]
    cu = torch.tensor(bounds, dtype=torch.int32)
    kernels = [
        ("aten._flash_attention_forward", fast_varlen._aten_varlen),
        ("SDPA per segment", _per_segment),
    ]
    reset_kernels_ran()
    with caplog.at_level(logging.WARNING, logger=fast_varlen.__name__):
        got = first_that_runs(kernels, q, k, v, cu, 20, 72**-0.5)
    assert got is not None
    want = reference_attention(q, k, v, bounds, 72**-0.5).reshape(30, -1)
    assert torch.equal(got, want)  # the same function on the same inputs
    assert [name for name, _ in kernels] == ["SDPA per segment"]  # the failing one is gone for later calls
    warning = [r for r in caplog.records if "falling back to SDPA per segment" in r.getMessage()]
    assert warning
    assert warning[0].levelno == logging.WARNING
    assert "aten._flash_attention_forward failed" in warning[0].getMessage()
    assert kernels_ran() == {"SDPA per segment": 1}


def test_with_every_kernel_failing_the_grouped_path_serves(caplog):
    q, k, v = _strided_qkv(16, 2, 80)  # Qwen2.5-VL-7B's head_dim
    kernels = [("aten._flash_attention_forward", fast_varlen._aten_varlen)]
    reset_kernels_ran()
    with caplog.at_level(logging.WARNING, logger=fast_varlen.__name__):
        assert first_that_runs(kernels, q, k, v, torch.tensor([0, 16], dtype=torch.int32), 16, 0.1) is None
    assert kernels == []
    assert any(f"falling back to {GROUPED}" in r.getMessage() for r in caplog.records)
    assert kernels_ran() == {}  # the grouped path is the caller's to run and count (fast.py)


def test_no_varlen_kernel_is_probed_off_cuda_and_the_tower_counts_its_grouped_calls():
    from tests.unit.test_fast import _packed_inputs, make_tower
    from vitserve.model.fast import optimize

    assert fast_varlen.probed_kernels(torch.device("cpu"), torch.bfloat16, 2, 80) == []
    tower = optimize(make_tower("qwen2_5_vl"), "qwen2_5_vl")  # 4 blocks: 4 attention calls a forward
    reset_kernels_ran()
    with torch.inference_mode():
        tower(*_packed_inputs(tower, [(1, 8, 8), (1, 4, 6)]))
    assert kernels_ran() == {GROUPED: 4}
