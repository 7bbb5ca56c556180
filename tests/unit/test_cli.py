"""Flags, VITSERVE_* environment, aliases and validation -> one frozen Config (docs/api.md)."""

from __future__ import annotations

import pytest

from vitserve.cli import FLAGS, build_config, env_name, parse_size
from vitserve.config import MIB, Config
from vitserve.errors import ConfigError


def test_no_flags_no_env_gives_the_spec_defaults():
    c = build_config([], {})
    assert c == Config()
    assert (c.model, c.tp, c.dp, c.visual_batch_max_tokens, c.visual_infer_batch_size) == ("demo", 1, 1, 8192, 64)
    assert (c.host, c.port, c.max_images_per_request, c.max_request_bytes) == ("127.0.0.1", 8100, 32, 64 * MIB)
    assert (c.max_image_pixels, c.request_timeout_s, c.heartbeat_s, c.dist_timeout_s) == (50_000_000, 120, 60, 1800)
    assert c.queue_token_limit == 4 * 8192
    assert not c.allow_image_urls
    assert c.allowed_url_domains == ()
    assert c.api_key is None
    assert c.llm_endpoint is None


def test_every_config_field_of_spec_has_a_flag():
    spec_flags = {"model", "model_family", "tp", "dp", "visual_batch_max_tokens", "visual_infer_batch_size",
                  "host", "port", "llm_endpoint", "max_queue_tokens", "max_images_per_request",
                  "max_request_bytes", "max_image_pixels", "request_timeout_s", "heartbeat_s", "dist_timeout_s",
                  "device", "dtype", "visual_reserved_mem_gb", "api_key", "allow_image_urls",
                  "allowed_url_domains", "cache_gb", "log_level"}
    assert spec_flags <= set(FLAGS)


def test_env_is_read_and_the_flag_wins():
    env = {"VITSERVE_TP": "2", "VITSERVE_VISUAL_BATCH_MAX_TOKENS": "1024", "VITSERVE_API_KEY": "k"}
    c = build_config(["--tp", "4"], env)
    assert c.tp == 4
    assert c.visual_batch_max_tokens == 1024
    assert c.api_key == "k"
    assert c.queue_token_limit == 4096


def test_hyphenated_aliases():
    c = build_config(["--visual-batch-max-tokens", "512", "--max-images-per-request", "3", "--allow-image-urls"], {})
    assert (c.visual_batch_max_tokens, c.max_images_per_request, c.allow_image_urls) == (512, 3, True)


def test_domains_are_a_comma_list_and_url_switch_reads_env():
    c = build_config(["--allowed_url_domains", "Example.com, cdn.example.org,,"],
                     {"VITSERVE_ALLOW_IMAGE_URLS": "true"})
    assert c.allowed_url_domains == ("example.com", "cdn.example.org")
    assert c.allow_image_urls
    assert not build_config(["--no-allow_image_urls"], {"VITSERVE_ALLOW_IMAGE_URLS": "1"}).allow_image_urls


def test_runtime_dir_and_torchrun_rendezvous_come_from_the_environment():
    c = build_config([], {"VITSERVE_RUNTIME_DIR": "/tmp/x", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert (c.runtime_dir, c.master_addr, c.master_port) == ("/tmp/x", "10.1.2.3", 29500)
    assert build_config([], {}).master_addr is None


def test_sizes_and_optional_values():
    assert parse_size("64MiB") == 64 * MIB
    assert parse_size("1024") == 1024
    assert parse_size("1.5G") == int(1.5 * 1024**3)
    c = build_config(["--max_request_bytes", "2MiB", "--max_queue_tokens", "100", "--llm_endpoint",
                      "ipc:///tmp/llm.sock", "--visual_reserved_mem_gb", "1.5", "--max_image_pixels", "1_000"], {})
    assert (c.max_request_bytes, c.max_queue_tokens, c.llm_endpoint) == (2 * MIB, 100, "ipc:///tmp/llm.sock")
    assert (c.visual_reserved_mem_gb, c.max_image_pixels) == (1.5, 1000)
    assert build_config(["--visual_batch_max_tokens", "0"], {}).queue_token_limit is None


@pytest.mark.parametrize(("argv", "env", "names"), [
    (["--tp", "0"], {}, "--tp"),
    (["--tp", "two"], {}, "--tp"),
    ([], {"VITSERVE_DP": "x"}, "VITSERVE_DP"),
    (["--port", "70000"], {}, "--port"),
    (["--model_family", "llama"], {}, "--model_family"),
    (["--dtype", "int8"], {}, "--dtype"),
    (["--device", "tpu"], {}, "--device"),
    (["--llm_endpoint", "http://x"], {}, "--llm_endpoint"),
    (["--visual_batch_max_tokens", "-1"], {}, "--visual_batch_max_tokens"),
    (["--max_request_bytes", "lots"], {}, "--max_request_bytes"),
    ([], {"VITSERVE_ALLOW_IMAGE_URLS": "maybe"}, "VITSERVE_ALLOW_IMAGE_URLS"),
])
def test_bad_values_fail_naming_the_knob(argv, env, names):
    with pytest.raises(ConfigError, match=names):
        build_config(argv, env)


def test_unknown_flag_exits_nonzero():
    with pytest.raises(SystemExit) as exc:
        build_config(["--no_such_flag", "1"], {})
    assert exc.value.code != 0


def test_env_names():
    assert env_name("visual_batch_max_tokens") == "VITSERVE_VISUAL_BATCH_MAX_TOKENS"
