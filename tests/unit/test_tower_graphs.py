"""Token buckets and the stem/body/tail forward (vitserve/model/buckets.py, tower_graphs.py).

On the CPU: a batch padded up to its bucket (padding in segments of its own, empty segments up to the graph's
slots) gives the same rows as HF's unpadded forward, for every Qwen tower kind (windows, DeepStack); the
bucket and key choice; the eager fallback. The CUDA tests (graph capture and replay, the varlen kernel) are
skipped without a device; bench/gpu_check.sh runs them on one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.vision_utils import get_vision_window_index

from tests.unit.test_fast import GRIDS, QWEN, _packed_inputs, assert_close, make_tower
from vitserve.model.buckets import (
    GraphKey,
    choose_bucket,
    fill_slots,
    ladder_keys,
    pad_bounds,
    pick_key,
    segments_needed,
    window_slots_bound,
)
from vitserve.model.fast import optimize
from vitserve.model.tower_graphs import TowerRunner, install, installed

BUCKETS = (64, 256, 1024)  # the GRIDS batches are 64..488 patches: every case pads
LADDER = (1, 4, 16)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=QWEN)
def towers(request):
    family = request.param
    reference = make_tower(family)
    fast = optimize(copy.deepcopy(reference), family)
    return family, reference, fast, TowerRunner(fast, BUCKETS, LADDER)


def _assert_same(got, want) -> None:
    merged, levels = got
    assert_close(merged, want.pooler_output)
    want_levels = list(getattr(want, "deepstack_features", None) or [])
    assert len(levels) == len(want_levels)
    for g, w in zip(levels, want_levels, strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("case", list(GRIDS))
def test_padded_to_bucket_equals_hf_unpadded(towers, case):
    family, reference, _, runner = towers
    pixels, grid_thw = _packed_inputs(reference, GRIDS[case])
    with torch.inference_mode():
        prep = runner.stem(pixels, grid_thw)
        key = runner.key_for(prep, runner.keys)
        got = runner.forward(pixels, grid_thw, pad_eagerly=True)
        want = reference(pixels, grid_thw)
    assert key is not None
    assert key.bucket == choose_bucket(prep.rows, BUCKETS)
    if key.bucket > prep.rows:  # the case really padded; equal rows are still checked below either way
        full, window = runner.padded_offsets(prep, key)
        assert full[-1] == key.bucket
        assert len(full) == key.full_slots + 1
        assert window is None or (window[-1] == key.bucket and len(window) == key.window_slots + 1)
    _assert_same(got, want)


def test_unpadded_body_and_the_eager_fallback_equal_hf(towers):
    family, reference, fast, _ = towers
    small = TowerRunner(fast, buckets=(64,), image_ladder=(1,))  # the mixed batch (488 rows) fits no graph
    pixels, grid_thw = _packed_inputs(reference, GRIDS["mixed"])
    with torch.inference_mode():
        assert small.key_for(small.stem(pixels, grid_thw), small.keys) is None
        got = small.forward(pixels, grid_thw, pad_eagerly=True)
        want = reference(pixels, grid_thw)
    _assert_same(got, want)


def test_padding_rows_never_reach_real_rows(towers):
    """Garbage in the padding rows changes nothing: they are attention segments of their own."""
    family, reference, _, runner = towers
    pixels, grid_thw = _packed_inputs(reference, GRIDS["odd_merged_grid"])
    with torch.inference_mode():
        prep = runner.stem(pixels, grid_thw)
        key = runner.key_for(prep, runner.keys)
        assert key is not None
        assert key.bucket > prep.rows
        clean = runner.tail(prep, *runner.run_padded(prep, key))
        pad = key.bucket - prep.rows
        prep.hidden = torch.cat([prep.hidden, 50 * torch.randn(pad, prep.hidden.shape[1])])
        prep.cos = torch.cat([prep.cos, torch.randn(pad, prep.cos.shape[1])])
        prep.sin = torch.cat([prep.sin, torch.randn(pad, prep.sin.shape[1])])
        prep.full_bounds = pad_bounds(prep.full_bounds, key.bucket, key.bucket)
        if prep.window_bounds is not None:
            prep.window_bounds = pad_bounds(prep.window_bounds, key.bucket, runner.window_rows)
        noisy = runner.tail(prep, *runner.run_unpadded(prep))
    assert_close(noisy[0][: clean[0].shape[0]], clean[0])


def test_installed_runner_serves_the_adapter_forward():
    from vitserve.model import load_encoder
    from vitserve.model.demo import build_demo_visual  # noqa: F401 (the demo checkpoint's builder)

    enc = load_encoder("demo")
    pixels, grid_thw = _packed_inputs(enc.visual, [(1, 8, 8), (1, 4, 6)])
    with torch.inference_mode():
        want = enc.adapter.forward(enc.visual, pixels, grid_thw)[0]
        install(enc.visual, TowerRunner(enc.visual, BUCKETS, LADDER))
        assert installed(enc.visual) is not None
        got = enc.adapter.forward(enc.visual, pixels, grid_thw)[0]  # no graphs on CPU: eager, unpadded
    assert_close(got, want)


def test_capture_refuses_a_cpu_tower_and_forward_stays_eager(towers):
    _, _, fast, runner = towers
    with pytest.raises(ValueError, match="needs a CUDA tower"):
        runner.capture(torch.float32)
    assert runner.graphs == {}  # nothing captured: forward without pad_eagerly runs unpadded


def test_compile_blocks_is_refused_on_a_cpu_tower(towers):
    _, _, fast, _ = towers
    with pytest.raises(ValueError, match="compile_blocks is for a CUDA tower"):
        TowerRunner(fast, BUCKETS, LADDER, compile_blocks=True)


def test_buckets_must_hold_whole_merge_units():
    with pytest.raises(ValueError, match="multiples of 4"):
        TowerRunner(make_tower("qwen2_vl"), buckets=(64, 130))


# ---- the pure bucket logic ---------------------------------------------------------------------------
def test_choose_bucket_is_the_smallest_that_holds():
    assert choose_bucket(1, BUCKETS) == 64
    assert choose_bucket(64, BUCKETS) == 64
    assert choose_bucket(65, BUCKETS) == 256
    assert choose_bucket(1024, BUCKETS) == 1024
    assert choose_bucket(1025, BUCKETS) is None


def test_pad_bounds_and_fill_slots():
    assert pad_bounds([0, 10, 30], 30, 8) == [0, 10, 30]
    assert pad_bounds([0, 10, 30], 50, 8) == [0, 10, 30, 38, 46, 50]
    assert fill_slots([0, 10, 30], 4) == [0, 10, 30, 30, 30]
    with pytest.raises(ValueError, match="do not fit in 1 slots"):
        fill_slots([0, 10, 30], 1)
    with pytest.raises(ValueError, match="do not fit"):
        pad_bounds([0, 10, 30], 20, 8)
    with pytest.raises(ValueError, match="chunk"):
        pad_bounds([0, 10], 20, 0)


def test_pick_key_takes_the_cheapest_graph_that_holds_the_padded_batch():
    keys = [GraphKey(256, 2, 0), GraphKey(256, 5, 0), GraphKey(1024, 2, 0), GraphKey(1024, 17, 0)]
    assert pick_key(keys, 200, 1, 0, 1) == GraphKey(256, 2, 0)  # one image + one padding segment
    assert pick_key(keys, 256, 2, 0, 1) == GraphKey(256, 2, 0)  # no padding: two images fill 2 slots
    assert pick_key(keys, 200, 3, 0, 1) == GraphKey(256, 5, 0)
    assert pick_key(keys, 200, 6, 0, 1) == GraphKey(1024, 17, 0)  # no 256 graph holds 7 segments
    assert pick_key(keys, 2000, 1, 0, 1) is None  # above the largest bucket: eager
    assert pick_key(keys, 200, 40, 0, 1) is None  # more images than any graph: eager
    windowed = [GraphKey(256, 5, 10)]
    assert segments_needed(3, 256 - 200, 64) == 4
    assert pick_key(windowed, 200, 2, 6, 64) == GraphKey(256, 5, 10)  # 6 windows + 1 padding segment
    assert pick_key(windowed, 100, 2, 7, 64) == GraphKey(256, 5, 10)  # 7 windows + 3 of padding (156 rows)
    assert pick_key(windowed, 100, 2, 8, 64) is None  # 8 + 3 > 10


def test_ladder_keys_hold_their_worst_batch():
    keys = ladder_keys((64, 1024), (1, 4, 64), window_rows=64)
    assert [k.bucket for k in keys] == [64, 64, 64, 1024, 1024, 1024]
    assert [k.full_slots for k in keys] == [2, 5, 17, 2, 5, 65]  # 64 rows hold at most 16 images of 4
    assert ladder_keys((64,), (1,), window_rows=None) == [GraphKey(64, 2, 0)]


@pytest.mark.parametrize("seed", range(5))
def test_window_slots_bound_bounds_hf_window_count(seed):
    """The window capacity a graph is captured with holds every batch of its rows and images."""
    gen = torch.Generator().manual_seed(seed)
    grids = [(1, 2 * int(torch.randint(1, 40, (1,), generator=gen)), 2 * int(torch.randint(1, 40, (1,), generator=gen))) for _ in range(6)]  # fmt: skip
    grids.append((1, 2, 2 * 60))  # the skinniest image: most windows per row
    grid_thw = torch.tensor(grids)
    _, cu_window = get_vision_window_index(grid_thw, spatial_merge_size=2, window_size=112, patch_size=14)
    rows = int(grid_thw.prod(-1).sum())
    assert len(cu_window) - 1 <= window_slots_bound(rows, len(grids), 64)


# ---- CUDA (skipped without a device; bench/gpu_check.sh runs them) --------------------------------------
@cuda
@pytest.mark.parametrize("head_dim", [80, 72])  # Qwen2.5-VL-7B's, Qwen3-VL-8B's
def test_cuda_varlen_probe_and_one_call_attention(head_dim):
    from vitserve.model.fast_varlen import (
        kernels_ran,
        reference_attention,
        reset_kernels_ran,
        varlen_attention,
    )

    device = torch.device("cuda")
    qkv = torch.randn(150, 3, 4, head_dim, device=device, dtype=torch.bfloat16)  # as a real call: views
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    bounds = [0, 64, 64, 128, 150, 150]  # empty segments, as bucket padding leaves
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    reset_kernels_ran()
    got = varlen_attention(q, k, v, cu, 64, head_dim**-0.5)
    assert got is not None, f"no varlen kernel ran on this CUDA device at head_dim {head_dim}"
    assert sum(kernels_ran().values()) == 1
    want = reference_attention(q.float(), k.float(), v.float(), bounds, head_dim**-0.5).reshape(150, -1)
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()  # bf16: 8-bit mantissa


@cuda
@pytest.mark.parametrize("family", QWEN)
def test_cuda_graph_replay_equals_eager(family):
    device = torch.device("cuda")
    tower = optimize(make_tower(family).to(device, torch.bfloat16), family)
    runner = TowerRunner(tower, BUCKETS, LADDER)
    pixels, grid_thw = _packed_inputs(tower, GRIDS["mixed"])
    pixels, grid_thw = pixels.to(device, torch.bfloat16), grid_thw.to(device)
    with torch.inference_mode():
        eager = runner.forward(pixels, grid_thw)  # no graphs yet: unpadded; also runs the varlen probe
        runner.capture(torch.bfloat16)
        replayed = [runner.forward(pixels, grid_thw) for _ in range(2)]  # twice: static buffers reused
    for merged, levels in replayed:
        scale = eager[0].float().abs().max().item()
        assert (merged.float() - eager[0].float()).abs().max().item() <= 2e-2 * scale
        assert len(levels) == len(eager[1])


# ---- --cuda_graphs at start-up ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"device": "cpu"}, "--device cpu"),
        ({"dtype": "float32"}, "--dtype float32"),
        ({"tp": 2}, "--tp 2"),
    ],
)
def test_cuda_graphs_refused_where_they_cannot_work(overrides, named):
    from vitserve import preflight
    from vitserve.config import Config
    from vitserve.errors import ConfigError

    with pytest.raises(ConfigError, match=f"--cuda_graphs does not work with {named}"):
        preflight.check(Config(model="demo", cuda_graphs=True, **overrides))
    preflight.check(Config(model="demo", cuda_graphs=True, device="cuda", dtype="bfloat16"))  # accepted


def test_serving_buckets_end_at_the_budgets_rows_and_the_image_cap():
    """A budget counts merged tokens, a bucket patch rows: 4 rows per token for every Qwen tower."""
    from vitserve.worker.graphs import serving_buckets
    from vitserve.worker.reservation import StressShape

    assert serving_buckets(StressShape(16384, 64), 4) == (
        [1024, 2048, 4096, 8192, 16384, 32768, 65536],
        [1, 4, 16, 64],
    )
    assert serving_buckets(StressShape(4096, 64), 4)[0] == [1024, 2048, 4096, 8192, 16384]
    assert serving_buckets(StressShape(3000, 8), 4) == ([1024, 2048, 4096, 8192, 12000], [1, 4, 8])
    assert serving_buckets(StressShape(0, 2), 4)[0] == [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def _full_batches(patch: int) -> dict[str, list[tuple[int, int, int]]]:
    """Batches of a 16,384-token budget (65,536 rows) in patches (t, h, w), merge 2: one image of the whole
    budget, 64 equal images (448 px at patch 14), a mixed set filled up to the budget."""
    mixed = [(1, 2 * h, 2 * w) for h, w in [(8, 8), (12, 16), (17, 23), (24, 12), (19, 29), (10, 10)]]
    fill, used = [], 0
    while used + mixed[len(fill) % 6][1] * mixed[len(fill) % 6][2] // 4 <= 16384 and len(fill) < 64:
        grid = mixed[len(fill) % 6]
        fill.append(grid)
        used += grid[1] * grid[2] // 4
    return {"one image": [(1, 256, 256)], "64 images": [(1, 32, 32)] * 64, "mixed": fill}


@pytest.mark.parametrize(
    "family", ["qwen2_5_vl", "qwen3_vl"]
)  # Qwen2.5-VL-7B's kind (windows), Qwen3-VL-8B's
def test_a_16384_token_budget_replays_in_a_graph(family):
    """The StressShape a rank gets for --visual_batch_max_tokens 16384 --visual_infer_batch_size 64: every
    full batch of that budget (65,536 patch rows) has a graph, so --cuda_graphs replays at production size."""
    from vitserve.config import Config
    from vitserve.worker.graphs import serving_buckets
    from vitserve.worker.reservation import StressShape

    shape = StressShape.of(Config(model="demo", visual_batch_max_tokens=16384, visual_infer_batch_size=64))
    tower = make_tower(family)  # tiny widths; the real patch, merge and window sizes
    merge = int(tower.spatial_merge_size)
    runner = TowerRunner(tower, *serving_buckets(shape, merge * merge))
    for name, grids in _full_batches(int(tower.config.patch_size)).items():
        grid_thw = torch.tensor(grids)
        rows = int(grid_thw.prod(-1).sum())
        assert rows <= 4 * shape.visual_batch_max_tokens
        key = runner.key_for_grid(grid_thw, runner.keys)
        assert key is not None, f"{family}: no graph holds the {name} batch ({rows} rows)"
        assert key.bucket == choose_bucket(rows, [k.bucket for k in runner.keys])
    assert max(k.bucket for k in runner.keys) == 65536


def test_capture_for_serving_refuses_a_cpu_rank():
    from vitserve.errors import ConfigError
    from vitserve.model import load_encoder
    from vitserve.worker.graphs import capture_for_serving
    from vitserve.worker.reservation import Method, Reservation, StressShape

    enc = load_encoder("demo")
    with pytest.raises(ConfigError, match="needs a Qwen tower on a CUDA device"):
        capture_for_serving(enc, StressShape(1024, 4), Reservation(1, Method.FULL), None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_rank_without_a_gpu_refuses_cuda_graphs_before_loading():
    from types import SimpleNamespace

    from vitserve.config import Config
    from vitserve.errors import ConfigError
    from vitserve.worker.rank import RankWorker

    worker = object.__new__(RankWorker)  # only _init_device: no sockets, no engine
    worker.cfg, worker.args, worker.distributed = (
        Config(model="demo", cuda_graphs=True),
        SimpleNamespace(),
        False,
    )
    with pytest.raises(ConfigError, match="--cuda_graphs needs a CUDA device and none is available"):
        worker._init_device()
    worker.cfg = Config(model="demo")
    worker._init_device()  # without the flag the CPU serves
    assert worker.device.type == "cpu"


def _calls(fn) -> list[str]:
    """The dotted names of the calls in fn's source, in order (ast: no CUDA needed to read them)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return [ast.unparse(n.func) for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))]


def test_the_graph_pool_is_read_with_one_side_stream_and_no_cached_blocks():
    """Structural (capture needs a device): one side stream per capture, shared by every key's warm-up and
    capture; the free cached blocks released before the pool is read at both ends; the rank then holds its
    reservation again and PeakWatch counts from after the capture."""
    from vitserve.model import tower_graphs
    from vitserve.worker.graphs import capture_for_serving

    capture = _calls(TowerRunner.capture)
    assert capture.count("torch.cuda.Stream") == 1
    assert capture.count("_settled_reserved") == 2
    assert "torch.cuda.Stream" not in _calls(TowerRunner._capture_one)
    assert _calls(tower_graphs._settled_reserved)[:2] == ["torch.cuda.synchronize", "torch.cuda.empty_cache"]
    serving = _calls(capture_for_serving)
    after = serving[serving.index("runner.capture") :]
    assert after.index("CudaMeter(device).hold") < after.index("torch.cuda.reset_peak_memory_stats")
