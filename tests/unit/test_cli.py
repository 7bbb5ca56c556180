"""Flags, VITSERVE_* environment, aliases and validation -> one frozen Config (docs/api.md)."""

from __future__ import annotations

import pytest

import vitserve
from vitserve.cli import OPENMP_SPIN, openmp_defaults
from vitserve.config import MIB, Config
from vitserve.errors import ConfigError
from vitserve.flags import FLAGS, GROUPS, build_config, build_parser, default_text, env_name
from vitserve.flags.spec import parse_size


def test_no_flags_no_env_gives_the_spec_defaults():
    c = build_config([], {})
    assert c == Config()
    assert (c.model, c.tp, c.dp, c.visual_batch_max_tokens, c.visual_infer_batch_size) == (
        "demo",
        1,
        1,
        8192,
        64,
    )
    assert (c.host, c.port, c.max_images_per_request, c.max_request_bytes) == (
        "127.0.0.1",
        8100,
        32,
        64 * MIB,
    )
    assert (c.max_image_pixels, c.request_timeout_s, c.heartbeat_s, c.dist_timeout_s) == (
        50_000_000,
        120,
        60,
        1800,
    )
    assert c.queue_token_limit == 4 * 8192
    assert not c.allow_image_urls
    assert c.allowed_url_domains == ()
    assert c.api_key is None
    assert c.llm_endpoint is None


def test_every_config_field_of_spec_has_a_flag():
    spec_flags = {
        "model",
        "model_family",
        "tp",
        "dp",
        "visual_batch_max_tokens",
        "visual_infer_batch_size",
        "host",
        "port",
        "llm_endpoint",
        "max_queue_tokens",
        "max_images_per_request",
        "max_request_bytes",
        "max_image_pixels",
        "request_timeout_s",
        "heartbeat_s",
        "dist_timeout_s",
        "device",
        "dtype",
        "visual_reserved_mem_gb",
        "api_key",
        "allow_image_urls",
        "allowed_url_domains",
        "cache_gb",
        "log_level",
    }
    assert spec_flags <= set(FLAGS)


def test_env_is_read_and_the_flag_wins():
    env = {"VITSERVE_TP": "2", "VITSERVE_VISUAL_BATCH_MAX_TOKENS": "1024", "VITSERVE_API_KEY": "k"}
    c = build_config(["--tp", "4"], env)
    assert c.tp == 4
    assert c.visual_batch_max_tokens == 1024
    assert c.api_key == "k"
    assert c.queue_token_limit == 4096


def test_hyphenated_aliases():
    c = build_config(
        ["--visual-batch-max-tokens", "512", "--max-images-per-request", "3", "--allow-image-urls"], {}
    )
    assert (c.visual_batch_max_tokens, c.max_images_per_request, c.allow_image_urls) == (512, 3, True)


def test_domains_are_a_comma_list_and_url_switch_reads_env():
    c = build_config(
        ["--allowed_url_domains", "Example.com, cdn.example.org,,"], {"VITSERVE_ALLOW_IMAGE_URLS": "true"}
    )
    assert c.allowed_url_domains == ("example.com", "cdn.example.org")
    assert c.allow_image_urls
    assert not build_config(["--no-allow_image_urls"], {"VITSERVE_ALLOW_IMAGE_URLS": "1"}).allow_image_urls


def test_runtime_dir_and_torchrun_rendezvous_come_from_the_environment():
    c = build_config(
        [], {"VITSERVE_RUNTIME_DIR": "/tmp/x", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    )
    assert (c.runtime_dir, c.master_addr, c.master_port) == ("/tmp/x", "10.1.2.3", 29500)
    assert build_config([], {}).master_addr is None


def test_node_flags_win_over_torchrun_environment():
    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    c = build_config(["--tp", "2"], env)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (2, 1, "10.1.2.3", 29500)
    c = build_config(["--tp", "2", "--master_addr", "node0", "--node_rank", "0"], env)
    assert (c.node_rank, c.master_addr) == (0, "node0")
    with pytest.raises(ConfigError, match="--nnodes must be > 0"):
        build_config(["--nnodes", "0"], {})


def test_sizes_and_optional_values():
    assert parse_size("64MiB") == 64 * MIB
    assert parse_size("1024") == 1024
    assert parse_size("1.5G") == int(1.5 * 1024**3)
    c = build_config(
        [
            "--max_request_bytes",
            "2MiB",
            "--max_queue_tokens",
            "100",
            "--llm_endpoint",
            "ipc:///tmp/llm.sock",
            "--visual_reserved_mem_gb",
            "1.5",
            "--max_image_pixels",
            "1_000",
        ],
        {},
    )
    assert (c.max_request_bytes, c.max_queue_tokens, c.llm_endpoint) == (2 * MIB, 100, "ipc:///tmp/llm.sock")
    assert (c.visual_reserved_mem_gb, c.max_image_pixels) == (1.5, 1000)
    assert build_config(["--visual_batch_max_tokens", "0"], {}).queue_token_limit is None


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
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
        (["--video_decoders", "-1"], {}, r"--video_decoders must be 0\.\.64 \(0: no videos\), got -1"),
        (["--video_decoders", "65"], {}, r"--video_decoders must be 0\.\.64"),
        ([], {"VITSERVE_VIDEO_DECODERS": "two"}, "VITSERVE_VIDEO_DECODERS"),
        ([], {"VITSERVE_ALLOW_IMAGE_URLS": "maybe"}, "VITSERVE_ALLOW_IMAGE_URLS"),
    ],
)
def test_bad_values_fail_naming_the_knob(argv, env, names):
    with pytest.raises(ConfigError, match=names):
        build_config(argv, env)


def test_unknown_flag_exits_nonzero():
    with pytest.raises(SystemExit) as exc:
        build_config(["--no_such_flag", "1"], {})
    assert exc.value.code != 0


def test_env_names():
    assert env_name("visual_batch_max_tokens") == "VITSERVE_VISUAL_BATCH_MAX_TOKENS"


# -- --version and --help -------------------------------------------------------------------------------------
def test_version_prints_the_package_version_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"vitserve {vitserve.__version__}"


def _help_text() -> str:
    return build_parser().format_help()


def _group_of_each_option(help_text: str) -> dict[str, list[str]]:
    """'--flag' -> the --help sections listing it, read back from the rendered help."""
    groups: dict[str, list[str]] = {}
    section = None
    for line in help_text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            section = line[:-1]
        elif section and line.startswith("  -"):
            groups.setdefault(line.split()[0].rstrip(","), []).append(section)
    return groups


def test_every_flag_is_listed_in_exactly_one_named_group():
    listed = _group_of_each_option(_help_text())
    for flag, spec in FLAGS.items():
        assert spec.group in GROUPS, flag
        assert listed.get(f"--{flag}") == [spec.group], (flag, listed.get(f"--{flag}"))
    assert set(listed) == {f"--{f}" for f in FLAGS} | {"-h", "--version"}
    assert {spec.group for spec in FLAGS.values()} == set(GROUPS)  # no empty section


def test_help_shows_each_real_default_once_with_its_env_var():
    flat = " ".join(_help_text().split())  # argparse wraps lines anywhere
    for flag in FLAGS:
        assert f"[default: {default_text(flag)}; env {env_name(flag)}]" in flat, flag
        assert flat.count(env_name(flag) + "]") == 1, flag
    assert "None" not in flat
    assert "()" not in flat
    assert "--no-allow_image_urls" in flat
    assert "--no-jpeg_draft" in flat


@pytest.mark.parametrize(
    ("flag", "text"),
    [
        ("max_request_bytes", "64 MiB"),
        ("max_queue_tokens", "4 x budget"),
        ("llm_endpoint", "none"),
        ("api_key", "none"),
        ("allowed_url_domains", "none"),
        ("allow_image_urls", "off"),
        ("jpeg_draft", "off"),
        ("request_timeout_s", "120 s"),
        ("max_image_pixels", "50,000,000"),
        ("visual_batch_max_tokens", "8192"),
    ],
)
def test_default_texts_are_readable(flag, text):
    assert default_text(flag) == text


def test_shown_defaults_parse_back_to_the_config_defaults():
    """The text --help shows for a size is one the flag accepts, and it means the real default."""
    c = build_config(["--max_request_bytes", default_text("max_request_bytes").replace(" ", "")], {})
    assert c == Config()


def test_hidden_hyphen_aliases_still_work_for_switches():
    assert build_config(["--jpeg-draft"], {}).jpeg_draft  # the default is off, so this is the alias at work
    assert not build_config(["--jpeg-draft", "--no-jpeg-draft"], {}).jpeg_draft
    assert build_config(
        ["--allow-image-urls", "--allowed-url-domains", "a.test"], {}
    ).allowed_url_domains == ("a.test",)


def test_the_ranks_openmp_threads_sleep_after_a_short_spin_unless_the_user_chose():
    env: dict[str, str] = {}
    openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(OPENMP_SPIN)}
    env = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}  # a policy the user chose is kept whole
    openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}  # and libgomp's own spin for it: no GOMP_SPINCOUNT beside it
    openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "100"}
    openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100"}
