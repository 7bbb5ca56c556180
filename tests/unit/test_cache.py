"""EmbeddingCache: LRU bounded in bytes, metrics, and the configuration fingerprint."""

from __future__ import annotations

import pytest
import torch

from vitserve.config import Config
from vitserve.contract import EncodedImage
from vitserve.engine.local_cache import (
    EmbeddingCache,
    cache_bytes_from_gb,
    cache_fingerprint,
    cache_key,
    entry_nbytes,
    make_cache,
)
from vitserve.metrics import Metrics


def enc(rows: int, dim: int = 4, *, deepstack: int = 0, seed: int = 0) -> EncodedImage:
    """An entry of rows * dim fp32 values (+ deepstack tensors of the same shape)."""
    g = torch.Generator().manual_seed(seed)
    return EncodedImage(
        torch.randn(rows, dim, generator=g), [torch.randn(rows, dim, generator=g) for _ in range(deepstack)]
    )


ROW = 4 * 4  # bytes of one (1, 4) fp32 row


def test_miss_then_hit_returns_the_same_tensors_and_counts():
    metrics = Metrics()
    cache = EmbeddingCache(10 * ROW, metrics)
    value = enc(2, deepstack=1, seed=1)
    assert cache.get("a") is None
    assert cache.put("a", value)
    got = cache.get("a")
    assert got is not None
    # exact by construction: the cache hands back the tensor it stored
    assert torch.equal(got.embedding, value.embedding)
    assert [torch.equal(x, y) for x, y in zip(got.deepstack, value.deepstack, strict=True)] == [True]
    assert (cache.hits, cache.misses, cache.evictions, cache.bytes) == (1, 1, 0, 4 * ROW)
    assert metrics.value("vitserve_cache_hits_total", layer="local") == 1
    assert metrics.value("vitserve_cache_misses_total", layer="local") == 1
    assert metrics.value("vitserve_cache_bytes", layer="local") == 4 * ROW


def test_entry_bytes_count_embedding_and_deepstack_in_their_dtype():
    e = EncodedImage(torch.zeros(3, 8, dtype=torch.bfloat16), [torch.zeros(3, 8, dtype=torch.bfloat16)] * 2)
    assert entry_nbytes(e) == 3 * 3 * 8 * 2


def test_evicts_least_recently_used_by_bytes_and_never_exceeds_the_bound():
    metrics = Metrics()
    cache = EmbeddingCache(10 * ROW, metrics)
    cache.put("a", enc(3))
    cache.put("b", enc(3))
    cache.put("c", enc(3))  # 9 rows held
    assert cache.get("a") is not None  # a becomes most recent: LRU order is b, c, a
    cache.put("d", enc(5))  # needs 5 rows: b and c (3 + 3) must go, a stays
    assert "b" not in cache
    assert "c" not in cache
    assert "a" in cache
    assert "d" in cache
    assert cache.bytes == 8 * ROW <= cache.max_bytes
    assert cache.evictions == 2
    assert metrics.value("vitserve_cache_evictions_total", layer="local") == 2
    assert metrics.value("vitserve_cache_bytes", layer="local") == 8 * ROW


def test_bytes_stay_within_the_bound_over_many_puts():
    cache = EmbeddingCache(50 * ROW, Metrics())
    for k in range(200):
        cache.put(str(k), enc(1 + k % 13, seed=k))
        assert cache.bytes <= cache.max_bytes
        assert cache.bytes == sum(entry_nbytes(cache._entries[key][0]) for key in cache._entries)
    assert str(199) in cache  # the newest entry is always kept


def test_entry_larger_than_the_whole_cache_is_not_stored_and_evicts_nothing():
    cache = EmbeddingCache(10 * ROW, Metrics())
    cache.put("small", enc(2))
    assert cache.put("huge", enc(11)) is False
    assert "huge" not in cache
    assert "small" in cache
    assert cache.evictions == 0
    assert cache.put("exact", enc(10))  # exactly the bound fits (and evicts the rest)
    assert cache.bytes == 10 * ROW


def test_put_again_refreshes_without_double_counting():
    cache = EmbeddingCache(10 * ROW, Metrics())
    cache.put("a", enc(3))
    cache.put("b", enc(3))
    cache.put("a", enc(4))  # replaces a, becomes most recent
    assert cache.bytes == 7 * ROW
    cache.put("c", enc(3))  # 10 rows: fits exactly, nothing evicted
    assert cache.evictions == 0
    cache.put("d", enc(1))  # b is the oldest now
    assert "b" not in cache
    assert "a" in cache


def test_stored_entries_are_detached_cpu_tensors():
    x = torch.ones(2, 4, requires_grad=True) * 2  # has autograd history
    cache = EmbeddingCache(10 * ROW, Metrics())
    cache.put("a", EncodedImage(x))
    got = cache.get("a")
    assert got is not None
    assert not got.embedding.requires_grad
    assert got.embedding.device.type == "cpu"


def test_cache_gb_zero_builds_no_cache():
    assert make_cache(Config(cache_gb=0), Metrics()) is None
    assert cache_bytes_from_gb(0) == 0
    assert cache_bytes_from_gb(0.5) == 512 * 1024**2
    cache = make_cache(Config(cache_gb=0.001), Metrics())
    assert cache is not None
    assert cache.max_bytes == int(0.001 * 1024**3)
    with pytest.raises(ValueError, match="cache_gb"):
        EmbeddingCache(0, Metrics())


# ---------------------------------------------------------------------------------------------- fingerprint

BASE = {
    "weights": "ab" * 32,
    "model_name": "Qwen2.5-VL-7B-Instruct",
    "family": "qwen2_5_vl",
    "dtype": "float32",
    "device": "cpu",
}


def fp(config: Config | None = None, **overrides) -> str:
    return cache_fingerprint(config or Config(), **{**BASE, **overrides})


def test_fingerprint_is_stable():
    assert fp() == fp()
    assert len(fp()) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"config": Config(visual_batch_max_tokens=4096)},  # a changed budget
        {"weights": "cd" * 32},  # other weights, or another processor config (the digest covers both)
        {"model_name": "Qwen2-VL-2B-Instruct"},
        {"family": "qwen3_vl"},
        {"dtype": "bfloat16"},
        {"device": "cuda:0"},
        {"config": Config(image_resize="pil")},  # other pixels
        {"config": Config(tp=2)},
    ],
)
def test_fingerprint_changes_with_anything_that_changes_the_output(change):
    assert fp(**change) != fp()


def test_fingerprint_ignores_settings_that_do_not_change_the_output():
    assert fp(Config(dp=4, port=9000, cache_gb=2, request_timeout_s=5)) == fp()
    assert fp(device="cuda:0") == fp(device="cuda:3")  # only the device type counts


def test_a_changed_fingerprint_misses_for_the_same_image():
    cache = EmbeddingCache(10 * ROW, Metrics())
    image_id = "9f2c" * 16
    cache.put(cache_key(fp(), image_id), enc(2))
    assert cache.get(cache_key(fp(), image_id)) is not None
    assert cache.get(cache_key(fp(Config(visual_batch_max_tokens=1024)), image_id)) is None
    assert cache.get(cache_key(fp(model_name="other"), image_id)) is None
    assert cache.get(cache_key(fp(dtype="float16"), image_id)) is None
