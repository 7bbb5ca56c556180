"""Worst-case reservation (docs/design.md invariant 7) and its publication file (docs/engine.md)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from tests.checkpoints import make_checkpoint
from vitserve.config import GIB
from vitserve.errors import ConfigError
from vitserve.families import DISABLED_BUDGET_TOKENS
from vitserve.model import load_encoder
from vitserve.worker.reservation import Method, StressShape
from vitserve.worker.reservation.meter import POOL_FACTOR
from vitserve.worker.reservation.published import (
    publish_reservation,
    read_reservation,
    remove_killed,
    remove_reservation,
    reservation_path,
    write_json_atomic,
)
from vitserve.worker.reservation.stress import measure, override
from vitserve.worker.reservation.worst_case import near_square_grid, worst_case_items

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family -> a tiny real checkpoint (tests/checkpoints.py), written once per module."""
    paths: dict = {}

    def get(family: str):
        if family not in paths:
            paths[family] = make_checkpoint(family, tmp_path_factory.mktemp(family))
        return paths[family]

    return get


@pytest.fixture(scope="module")
def qwen25(checkpoint):
    return load_encoder(str(checkpoint("qwen2_5_vl")))


@pytest.fixture(scope="module")
def internvl(checkpoint):
    return load_encoder(str(checkpoint("internvl")))  # 56 px tiles of 14 px patches: 4 tokens per tile


# --- the worst-case batch -------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 4, 7, 64, 100, 257, 8191, 8192])
def test_grid_has_the_most_cells_under_the_budget(budget):
    rows, cols = near_square_grid(budget)
    grids = [(r, budget // r) for r in range(1, budget + 1)]
    best = max(r * c for r, c in grids if max(r, c) <= 200 * min(r, c))
    assert rows * cols == best <= budget
    assert rows <= cols <= 200 * rows


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_qwen_worst_case_is_one_image_at_the_budget(family, checkpoint):
    enc = load_encoder(str(checkpoint(family)))
    cfg = enc.visual.config
    items = worst_case_items(enc, budget_tokens=100, max_batch_images=8)
    assert len(items) == 1
    item = items[0]
    t, h, w = item.grid_thw
    assert (t, h % 2, w % 2) == (1, 0, 0)  # merge size 2
    assert item.num_tokens == (h // 2) * (w // 2) == 100  # 10x10 merged
    features = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    assert item.pixel_values.shape == (h * w, features)  # (patches, C*T*P*P)
    assert item.resized_size == (w * cfg.patch_size, h * cfg.patch_size)
    assert enc.encode(items)[0].embedding.shape == (100, enc.embed_dim)  # the production forward accepts it


def test_qwen_worst_case_of_a_prime_budget_is_a_long_strip(qwen25):
    # 101 is prime: 1x101 merged tokens (aspect 101 <= 200, which HF's processor still emits) beats 10x10
    (item,) = worst_case_items(qwen25, budget_tokens=101, max_batch_images=1)
    assert (item.num_tokens, item.grid_thw) == (101, (1, 2, 202))
    assert qwen25.encode([item])[0].embedding.shape[0] == 101


def test_budget_off_stresses_the_documented_default(qwen25):
    (item,) = worst_case_items(qwen25, budget_tokens=0, max_batch_images=4)
    assert item.num_tokens == DISABLED_BUDGET_TOKENS


def test_internvl_fills_the_budget_with_tiles_in_capped_images(internvl):
    # 4 tokens per tile (4x4 patches, pixel shuffle 0.5): budget 100 -> 25 tiles = 13 + 12
    items = worst_case_items(internvl, budget_tokens=100, max_batch_images=8, max_tiles_per_image=13)
    assert [i.pixel_values.shape[0] for i in items] == [13, 12]
    assert sum(i.num_tokens for i in items) == 100
    assert items[0].pixel_values.shape[1:] == (3, 56, 56)
    assert items[0].grid_thw == (13, 4, 4)
    out = internvl.encode(items)
    assert [o.embedding.shape[0] for o in out] == [52, 48]


def test_internvl_without_a_tile_cap_the_budget_bounds_the_batch(internvl):
    (item,) = worst_case_items(internvl, budget_tokens=101, max_batch_images=1)
    assert (item.pixel_values.shape[0], item.num_tokens) == (25, 100)


def test_internvl_respects_the_batch_image_cap(internvl):
    items = worst_case_items(internvl, budget_tokens=1000, max_batch_images=2, max_tiles_per_image=13)
    assert len(items) == 2
    assert sum(i.pixel_values.shape[0] for i in items) == 2 * 13


def test_internvl_tile_above_budget_is_a_config_error(internvl):
    with pytest.raises(ConfigError, match="visual_batch_max_tokens 3"):
        worst_case_items(internvl, budget_tokens=3, max_batch_images=2)


# --- the stress -------------------------------------------------------------------------------------------


def test_reserve_measures_a_positive_peak(qwen25):
    res = measure(qwen25, StressShape(256, 4))
    assert (res.source, res.method) == ("stress", Method.FULL)  # 256 tokens: too few to extrapolate from
    assert res.bytes > 0
    assert (res.tokens, res.images) == (256, 1)


def test_reserve_override_skips_the_stress(qwen25):
    res = override(qwen25.device, 1.5)
    assert (res.bytes, res.source, res.method) == (int(1.5 * GIB), "override", Method.OVERRIDE)


def test_negative_override_is_a_config_error(qwen25):
    with pytest.raises(ConfigError, match="--visual_reserved_mem_gb"):
        override(qwen25.device, -1)


# --- publication ------------------------------------------------------------------------------------------


def test_publish_writes_the_spec_fields(tmp_path):
    path = publish_reservation(tmp_path / "rt", "cuda:0", 1, 12345, "stress")
    assert path == tmp_path / "rt" / "reserved_mem_cuda:0_1.json"
    body = json.loads(path.read_text())
    assert body == {"device": "cuda:0", "rank": 1, "bytes": 12345, "source": "stress", "pid": os.getpid()}
    assert read_reservation(tmp_path / "rt", "cuda:0", 1) == body
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


def test_remove_deletes_and_tolerates_missing(tmp_path):
    publish_reservation(tmp_path, "cpu", 0, 1, "override")
    remove_reservation(tmp_path, "cpu", 0)
    assert not reservation_path(tmp_path, "cpu", 0).exists()
    assert read_reservation(tmp_path, "cpu", 0) is None
    remove_reservation(tmp_path, "cpu", 0)  # second time: nothing to do, no error


def test_remove_killed_takes_only_the_files_the_killed_processes_wrote(tmp_path):
    publish_reservation(tmp_path, "cpu", 0, 1, "stress")  # written by this process: "killed"
    publish_reservation(tmp_path, "cuda", 1, 1, "stress")
    other = {"device": "cpu", "rank": 2, "bytes": 1, "source": "stress", "pid": os.getpid() + 1}
    write_json_atomic(reservation_path(tmp_path, "cpu", 2), other)  # another service's rank 2
    remove_killed(tmp_path, [0, 1, 2, 3], [os.getpid()])
    assert [p.name for p in tmp_path.iterdir()] == ["reserved_mem_cpu_2.json"]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b"[]",
        b"null",
        b'{"device": "cpu"}',
        b'{"device": "cpu", "rank": 0, "bytes": "9", "source": "stress", "pid": 1}',
        b'{"device": "cpu", "rank": 0, "bytes": true, "source": "stress", "pid": 1}',
    ],
)
def test_reader_returns_none_for_garbage(tmp_path, content):
    reservation_path(tmp_path, "cpu", 0).write_bytes(content)
    assert read_reservation(tmp_path, "cpu", 0) is None


def test_reader_before_the_directory_exists_returns_none(tmp_path):
    assert read_reservation(tmp_path / "not" / "there", "cpu", 0) is None


def test_concurrent_reader_never_sees_a_partial_file(tmp_path):
    seen, bad = [], []
    done = threading.Event()

    def reader():
        while not done.is_set():
            body = read_reservation(tmp_path, "cpu", 3)
            if body is None:
                if seen:  # once published it must stay readable: a replace is never a gap
                    bad.append("vanished")
                continue
            if body["bytes"] != int(body["source"].split("-")[1]) * 1000:  # fields from one write
                bad.append(body)
            seen.append(body["bytes"])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(300):
            publish_reservation(tmp_path, "cpu", 3, n * 1000, f"stress-{n}")
    finally:
        done.set()
        thread.join()
    assert not bad
    assert seen  # the reader did overlap the writes
    assert sorted(seen) == seen  # it saw versions in order, each whole
    assert [p.name for p in tmp_path.iterdir()] == ["reserved_mem_cpu_3.json"]


# --- CUDA: the peak stays in the caching allocator (runs where a GPU is present) ---------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_stress_keeps_the_peak_and_a_second_worst_case_does_not_grow_the_pool(checkpoint):
    enc = load_encoder(str(checkpoint("qwen2_5_vl")), device="cuda")
    reserved_before = torch.cuda.memory_reserved()
    res = measure(enc, StressShape(2048, 4))
    held = torch.cuda.memory_reserved()
    assert res.method is Method.FULL
    assert res.bytes > 0
    # no empty_cache: the pool still holds the measured growth; the published bytes are that x POOL_FACTOR
    assert held - reserved_before >= res.bytes / POOL_FACTOR - 1
    enc.encode(worst_case_items(enc, 2048, 4))
    enc.encode(worst_case_items(enc, 512, 4) * 4)  # the same budget as four smaller images
    assert torch.cuda.memory_reserved() == held  # runtime at the budget fits in what was reserved


@cuda
def test_cuda_override_reserves_the_amount_in_the_allocator(checkpoint):
    enc = load_encoder(str(checkpoint("qwen2_5_vl")), device="cuda")
    before = torch.cuda.memory_reserved()
    res = override(enc.device, 0.25)
    assert (res.bytes, res.source) == (GIB // 4, "override")
    assert torch.cuda.memory_reserved() - before >= GIB // 4


def test_budget_off_with_the_processor_limit_is_max_images_of_the_largest_image(qwen25):
    items = worst_case_items(qwen25, budget_tokens=0, max_batch_images=3, max_image_tokens=64)
    assert [it.num_tokens for it in items] == [64, 64, 64]
    assert len({id(it.pixel_values) for it in items}) == 1  # equal images share one pixel tensor


def test_the_stress_shape_carries_the_processors_per_image_limits(checkpoint):
    from vitserve.config import Config
    from vitserve.processors import load_image_processor

    def shape(model: str, **flags) -> StressShape:
        config = Config(model=model, **flags)
        clamp = load_image_processor(model, config.visual_batch_max_tokens).clamp_info()
        return StressShape.of(config, clamp)

    qwen = str(checkpoint("qwen2_5_vl"))  # its preprocessor allows at most 64 tokens per image
    flags_only = StressShape.of(Config(model=qwen, visual_batch_max_tokens=256, visual_infer_batch_size=4))
    assert flags_only == StressShape(256, 4)
    off = shape(qwen, visual_batch_max_tokens=0, visual_infer_batch_size=4)
    assert (off.visual_batch_max_tokens, off.visual_infer_batch_size, off.max_image_tokens) == (0, 4, 64)
    assert shape(qwen, visual_batch_max_tokens=16).max_image_tokens == 16  # the clamp to the budget
    demo = shape("demo", visual_batch_max_tokens=0)
    assert demo.max_image_tokens == 16384  # the published Qwen2.5-VL processor's max_pixels / 28^2
    tiles = shape(str(checkpoint("internvl")), visual_batch_max_tokens=100)
    assert tiles.max_tiles_per_image is not None
    assert tiles.max_image_tokens == tiles.max_tiles_per_image * 4  # 4 tokens per tiny tile
