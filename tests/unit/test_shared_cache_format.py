"""The shared cache's pure parts: the entry format (engine/entry_format.py), the fingerprint that keys it
(the weights digest itself: tests/unit/test_checkpoint.py), the --cache_url / --cache_ttl_s flags, and that
no password is ever shown."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from vitserve.config import Config, redacted_url
from vitserve.contract import EncodedImage
from vitserve.engine.entry_format import FORMAT_VERSION, EntryError, decode_entry, encode_entry
from vitserve.engine.local_cache import cache_fingerprint
from vitserve.errors import ConfigError
from vitserve.flags import build_config


def entry(dtype: torch.dtype, tokens: int = 7, dim: int = 5, deepstack: int = 2) -> EncodedImage:
    gen = torch.Generator().manual_seed(tokens * dim + deepstack)
    make = lambda: torch.randn(tokens, dim, generator=gen).to(dtype)  # noqa: E731
    return EncodedImage(embedding=make(), deepstack=[make() for _ in range(deepstack)])


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deepstack", [0, 3])
def test_an_entry_comes_back_with_the_same_bytes_dtype_and_shape(dtype, deepstack):
    original = entry(dtype, deepstack=deepstack)
    back = decode_entry(encode_entry(original))
    for a, b in zip(
        [back.embedding, *back.deepstack], [original.embedding, *original.deepstack], strict=True
    ):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert raw(a) == raw(b)
    assert len(back.deepstack) == deepstack


def test_an_empty_embedding_and_a_non_contiguous_one_round_trip():
    wide = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    original = EncodedImage(embedding=wide.t(), deepstack=[torch.empty(0, 6)])
    back = decode_entry(encode_entry(original))
    assert torch.equal(back.embedding, wide.t())
    assert back.deepstack[0].shape == (0, 6)


def test_every_single_byte_flip_or_cut_is_refused():
    value = encode_entry(entry(torch.bfloat16, tokens=3, dim=2, deepstack=1))
    for i in range(len(value)):
        flipped = bytearray(value)
        flipped[i] ^= 0x01
        with pytest.raises(EntryError):
            decode_entry(bytes(flipped))
    for cut in (0, 5, 41, len(value) // 2, len(value) - 1):
        with pytest.raises(EntryError):
            decode_entry(value[:cut])
    with pytest.raises(EntryError):
        decode_entry(value + b"\0")


def test_another_version_or_a_foreign_value_is_refused_by_name():
    value = encode_entry(entry(torch.float32))
    newer = value[:4] + struct.pack("<H", FORMAT_VERSION + 1) + value[6:]
    with pytest.raises(EntryError, match=f"v{FORMAT_VERSION + 1}"):
        decode_entry(newer)
    with pytest.raises(EntryError, match="not a vitserve cache entry"):
        decode_entry(b"some other program's value under our key" * 2)


def test_a_dtype_the_wire_does_not_carry_is_refused_when_writing():
    with pytest.raises(ValueError, match="float64"):
        encode_entry(EncodedImage(embedding=torch.zeros(2, 2, dtype=torch.float64)))


# ----------------------------------------------------------------------------------- key and weights


def fingerprint(config: Config, **kw) -> str:
    args = {
        "weights": "w",
        "model_name": "m",
        "family": "qwen2_5_vl",
        "dtype": "bfloat16",
        "device": "cuda:0",
    }
    return cache_fingerprint(config, **{**args, **kw})


def test_the_fingerprint_follows_weights_and_output_settings_not_the_path():
    base = Config(model="/models/a")
    fp = fingerprint(base)
    assert fingerprint(replace(base, model="/mnt/elsewhere/a")) == fp  # same weights, other mount point
    assert fingerprint(base, device="cuda:3") == fp  # one GPU kind gives one output
    for changed in (
        fingerprint(base, weights="other"),
        fingerprint(base, dtype="float32"),
        fingerprint(base, family="qwen2_vl"),
        fingerprint(replace(base, jpeg_draft=True)),
        fingerprint(replace(base, image_resize="pil")),
        fingerprint(replace(base, visual_batch_max_tokens=1024)),
        fingerprint(replace(base, tp=2)),
    ):
        assert changed != fp


# ----------------------------------------------------------------------------------- flags


def test_cache_flags_parse_validate_and_read_the_environment():
    c = build_config(["--cache_url", "redis://cache:6379/2", "--cache_ttl_s", "3600"], {})
    assert (c.cache_url, c.cache_ttl_s) == ("redis://cache:6379/2", 3600.0)
    env = build_config([], {"VITSERVE_CACHE_URL": "rediss://:s3cret@cache:6380/0"})
    assert env.cache_url == "rediss://:s3cret@cache:6380/0"
    assert (Config().cache_url, Config().cache_ttl_s) == (None, 0.0)
    with pytest.raises(ConfigError, match="--cache_ttl_s must be >= 0"):
        build_config(["--cache_ttl_s", "-1"], {})


def test_a_bad_cache_url_is_refused_without_echoing_it():
    with pytest.raises(ConfigError, match="--cache_url must be redis://") as err:
        build_config(["--cache_url", "http://:hunter2@cache:6379"], {})
    assert "hunter2" not in str(err.value)


def test_the_password_never_shows_in_the_config_or_the_redacted_url():
    url = "rediss://user:hunter2@cache.internal:6380/3"
    assert "hunter2" not in repr(Config(cache_url=url))
    assert redacted_url(url) == "rediss://cache.internal:6380/3"
    assert redacted_url("redis://:pw@10.0.0.5/0") == "redis://10.0.0.5/0"
