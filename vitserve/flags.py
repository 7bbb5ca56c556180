"""The `vitserve` flags: each flag's parser, group and help, and flags + VITSERVE_* environment -> one Config.

This is the only place that reads the environment for settings (docs/api.md): each flag also reads
VITSERVE_<FLAG_UPPER> (the flag wins), and torchrun's environment (MASTER_ADDR, MASTER_PORT, GROUP_RANK,
WORLD_SIZE, ...: preflight.torchrun_values) fills the node flags no flag set. `build_config` validates what
a flag alone can tell (ranges, names, URL shapes) and raises ConfigError naming the flag; vitserve/cli.py
turns that into exit 2 and one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import vitserve
from vitserve import preflight
from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.families import FAMILY_CHOICES

T = TypeVar("T")
# Each video decoder is a process that may map up to 4 GiB (vitserve/video/decoder_pool.py): more than this many is a
# typo on any machine, not a setting.
MAX_VIDEO_DECODERS = 64
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '67108864', '64MiB', '64M', '1.5GB' (K/M/G/T are powers of 1024 either way)."""
    m = _SIZE.match(text.replace("_", "").replace(",", ""))
    if not m:
        raise ValueError(f"not a size: {text!r}")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def parse_int(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


def parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_domains(text: str) -> tuple[str, ...]:
    return tuple(d.strip().lower() for d in text.split(",") if d.strip())


def _optional(convert: Callable[[str], T]) -> Callable[[str], T | None]:
    return lambda text: None if text.strip().lower() in ("", "none") else convert(text)


class Flag(NamedTuple):
    parse: Callable[[str], Any]  # text (flag or env) -> value
    group: str  # the --help section it is listed under
    help: str
    default_text: str | None = None  # when the Config default alone would not say what happens


GROUPS = (
    "model",
    "server",
    "parallelism",
    "budget and limits",
    "LLM handoff",
    "cache",
    "security",
    "logging",
    "runtime",
)
# The one table of flags. Defaults come from Config, so there is one source of truth for them too.
FLAGS: dict[str, Flag] = {
    "model": Flag(
        str, "model", "local HF checkpoint directory, or 'demo' (random weights; embeddings mean nothing)"
    ),
    "model_family": Flag(str, "model", f"one of {', '.join(FAMILY_CHOICES)}"),
    "dtype": Flag(str, "model", "auto | float32 | bfloat16 | float16"),
    "host": Flag(str, "server", "HTTP bind address"),
    "port": Flag(parse_int, "server", "HTTP port"),
    "tp": Flag(parse_int, "parallelism", "tensor-parallel ranks per encoder group"),
    "dp": Flag(parse_int, "parallelism", "independent encoder groups sharing one queue"),
    "nnodes": Flag(parse_int, "parallelism", "nodes one TP group spans; each runs --tp / --nnodes ranks"),
    "node_rank": Flag(parse_int, "parallelism", "this node's index; 0 serves HTTP, others run ranks only"),
    "master_addr": Flag(
        _optional(str), "parallelism", "node 0's address, where the ranks meet (TCPStore)", "none (one node)"
    ),
    "master_port": Flag(
        _optional(parse_int), "parallelism", "node 0's TCPStore port (+ group index)", "29500 across nodes"
    ),
    "heartbeat_s": Flag(float, "parallelism", "rank-0 heartbeat interval"),
    "dist_timeout_s": Flag(float, "parallelism", "torch.distributed timeout"),
    "visual_batch_max_tokens": Flag(
        parse_int, "budget and limits", "token budget per batch AND per image (after merge); 0 disables"
    ),
    "visual_infer_batch_size": Flag(parse_int, "budget and limits", "at most this many images per batch"),
    "max_video_tokens": Flag(
        parse_int,
        "budget and limits",
        "tokens one video may cost in all (after merge): its frames shrink to fit; 0 disables",
    ),
    "visual_reserved_mem_gb": Flag(
        _optional(float),
        "budget and limits",
        "skip the start-up stress and reserve this much",
        "none (measure at start-up)",
    ),
    "cuda_graphs": Flag(
        parse_bool,
        "budget and limits",
        "CUDA, bf16/fp16, --tp 1, Qwen towers: replay the tower's forward from CUDA graphs captured per token "
        "bucket at start-up (their pool is added to the reservation); not yet measured on a GPU",
    ),
    "max_queue_tokens": Flag(
        _optional(parse_int), "budget and limits", "queued tokens above which requests get 503", "4 x budget"
    ),
    "max_images_per_request": Flag(parse_int, "budget and limits", "more images in one request -> 400"),
    "max_request_bytes": Flag(
        parse_size, "budget and limits", "larger body -> 413 (accepts sizes like 64MiB)"
    ),
    "max_image_pixels": Flag(
        parse_int, "budget and limits", "decoded width x height above this -> 413 (checked from the header)"
    ),
    "max_video_bytes": Flag(
        parse_size, "budget and limits", "larger video -> 413 (accepts sizes like 256MiB)"
    ),
    "max_video_duration_s": Flag(
        float, "budget and limits", "longer video -> 413 (checked from the container before decoding)"
    ),
    "max_video_frames": Flag(
        parse_int,
        "budget and limits",
        "a video with more frames -> 413 (counted by demuxing, before decoding)",
    ),
    "video_decoders": Flag(
        parse_int,
        "budget and limits",
        f"video decoder processes: videos decoded at a time, the rest wait (1..{MAX_VIDEO_DECODERS}); "
        "0 = this server takes no videos",
    ),
    "request_timeout_s": Flag(float, "budget and limits", "end-to-end deadline (504 after it)"),
    "image_resize": Flag(
        str,
        "budget and limits",
        "auto | torch | pil: whose pixels the embeddings equal; torch (= auto) is transformers' torchvision "
        "processor, which vLLM and SGLang use; pil its PIL processor (docs/processing.md)",
    ),
    "jpeg_draft": Flag(
        parse_bool,
        "budget and limits",
        "faster but NOT exact: decode big JPEGs at 1/2-1/8 scale when the budget clamp "
        "shrinks them anyway (docs/jpeg_draft.md)",
    ),
    "llm_endpoint": Flag(
        _optional(str),
        "LLM handoff",
        "ZMQ endpoint of the LLM server (tcp://host:port or ipc:///path); none: inline only",
    ),
    "llm_url": Flag(
        _optional(str),
        "LLM handoff",
        "OpenAI-compatible LLM server (vLLM with --enable-mm-embeds), http://host:port: serves "
        "/v1/chat/completions in front of it (docs/vllm.md); none: off",
    ),
    "llm_api_key": Flag(
        _optional(str), "LLM handoff", "sent to --llm_url as 'Authorization: Bearer KEY' (never logged)"
    ),
    "llm_timeout_s": Flag(float, "LLM handoff", "deadline for one completion from --llm_url (502/504 after)"),
    "llm_transport": Flag(
        str,
        "LLM handoff",
        "inline | ec_storage: embeddings in the JSON body to --llm_url, or written to --ec_storage_path for a "
        "vLLM encoder-cache consumer with a metadata-only part sent (docs/vllm.md)",
    ),
    "ec_storage_path": Flag(
        _optional(str), "LLM handoff", "the vLLM EC consumer's shared_storage_path (ec_storage only)"
    ),
    "ec_ttl_s": Flag(float, "LLM handoff", "an encoder-cache file no request uses is removed after this"),
    "ec_storage_gb": Flag(
        float, "LLM handoff", "bound on the encoder-cache files' bytes; least recently used go first"
    ),
    "cache_gb": Flag(float, "cache", "encoder-output cache size; 0 disables"),
    "cache_url": Flag(
        _optional(str),
        "cache",
        "shared cache for replicas: redis://[:PASSWORD@]HOST:PORT/DB or rediss:// (TLS); none: off",
    ),
    "cache_ttl_s": Flag(float, "cache", "TTL of shared-cache entries; 0: none (Redis's maxmemory evicts)"),
    "api_key": Flag(
        _optional(str), "security", "require 'Authorization: Bearer KEY' on every route but /health"
    ),
    "allow_image_urls": Flag(parse_bool, "security", "accept {'url': ...} images (SSRF-guarded)"),
    "allowed_url_domains": Flag(
        parse_domains, "security", "comma-separated domains URL images may come from"
    ),
    "log_level": Flag(str, "logging", "debug | info | warning | error"),
    "otlp_endpoint": Flag(
        _optional(str),
        "logging",
        "OTLP/HTTP collector for /encode spans, e.g. http://127.0.0.1:4318 (docs/tracing.md); none: off",
    ),
    "device": Flag(str, "runtime", "auto | cpu | cuda | cuda:N"),
    "runtime_dir": Flag(str, "runtime", "private runtime directory (ipc sockets, reservation files)"),
}
_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in dataclasses.fields(Config)
}
_UNITS = {"_s": " s", "_gb": " GiB"}


def env_name(flag: str) -> str:
    return "VITSERVE_" + flag.upper()


def _size_text(n: int) -> str:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def default_text(flag: str) -> str:
    """The default as --help shows it: '64 MiB', 'none', 'on'/'off', '120 s', '50,000,000'."""
    spec, value = FLAGS[flag], _DEFAULTS[flag]
    if spec.default_text is not None:
        return spec.default_text
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(value)
    if spec.parse is parse_size:
        return _size_text(value)
    if isinstance(value, float):
        return f"{value:g}" + next((u for end, u in _UNITS.items() if flag.endswith(end)), "")
    if isinstance(value, int) and value >= 1_000_000:
        return f"{value:,}"
    return str(value)


def _metavar(flag: str) -> str:
    spec = FLAGS[flag]
    if spec.parse is parse_size:
        return "SIZE"
    if spec.parse is parse_int or flag.endswith("_tokens"):
        return "N"
    if flag.endswith("_s"):
        return "SECONDS"
    if flag.endswith("_gb"):
        return "GIB"
    return flag.rsplit("_", 1)[-1].upper()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitserve",
        description="Serve the vision encoder of a multimodal LLM.",
        epilog="Every flag also reads the environment variable shown with it (the flag wins); "
        "--flag_name and --flag-name are the same flag.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--version", action="version", version=f"vitserve {vitserve.__version__}")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for flag, spec in FLAGS.items():
        full_help = f"{spec.help} [default: {default_text(flag)}; env {env_name(flag)}]"
        names = [(flag, full_help)] + ([(flag.replace("_", "-"), argparse.SUPPRESS)] if "_" in flag else [])
        for name, help_text in names:  # the hyphenated alias works but is not listed a second time
            if isinstance(_DEFAULTS[flag], bool):  # switches: --flag / --no-flag
                groups[spec.group].add_argument(
                    f"--{name}", dest=flag, action=argparse.BooleanOptionalAction, help=help_text
                )
            else:
                groups[spec.group].add_argument(
                    f"--{name}", dest=flag, metavar=_metavar(flag), type=str, help=help_text
                )
    return p


def _convert(flag: str, raw: str | bool, source: str) -> object:
    if isinstance(raw, bool):
        return raw
    try:
        return FLAGS[flag][0](raw)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def build_config(argv: list[str] | None, environ: Mapping[str, str]) -> Config:
    """Flags, then VITSERVE_* env, then Config defaults. Raises ConfigError naming the knob."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}  # one type per flag (int, float, str, bool, tuple)
    for flag in FLAGS:
        if flag in args:
            values[flag] = _convert(flag, args[flag], f"--{flag}")
        elif env_name(flag) in environ:
            values[flag] = _convert(flag, environ[env_name(flag)], env_name(flag))
    for flag, value in preflight.torchrun_values(environ).items():
        values.setdefault(flag, value)
    config = Config(**values)
    validate(config)
    return config


def _positive(config: Config, *flags: str, allow_zero: bool = False) -> None:
    for flag in flags:
        value = getattr(config, flag)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise ConfigError(f"--{flag} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(config: Config) -> None:
    _positive(
        config,
        "tp",
        "dp",
        "nnodes",
        "visual_infer_batch_size",
        "max_images_per_request",
        "max_request_bytes",
        "max_image_pixels",
        "max_video_bytes",
        "max_video_duration_s",
        "max_video_frames",
        "request_timeout_s",
        "heartbeat_s",
        "dist_timeout_s",
        "llm_timeout_s",
        "ec_ttl_s",
        "ec_storage_gb",
    )
    _positive(
        config,
        "visual_batch_max_tokens",
        "max_video_tokens",
        "max_queue_tokens",
        "cache_gb",
        "cache_ttl_s",
        "visual_reserved_mem_gb",
        "node_rank",
        allow_zero=True,
    )
    if not 0 <= config.video_decoders <= MAX_VIDEO_DECODERS:
        raise ConfigError(
            f"--video_decoders must be 0..{MAX_VIDEO_DECODERS} (0: no videos), got {config.video_decoders}"
        )
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {config.port}")
    if config.model_family not in FAMILY_CHOICES:
        raise ConfigError(f"--model_family {config.model_family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    if config.image_resize not in ("auto", "torch", "pil"):
        raise ConfigError(f"--image_resize {config.image_resize!r} is not one of auto, torch, pil")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {config.dtype!r} is not one of auto, float32, bfloat16, float16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f"--device {config.device!r} is not one of auto, cpu, cuda, cuda:N")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"--log_level {config.log_level!r} is not one of debug, info, warning, error")
    if config.llm_endpoint is not None and not re.match(r"^(tcp|ipc)://.+", config.llm_endpoint):
        raise ConfigError(f"--llm_endpoint {config.llm_endpoint!r} must be tcp://host:port or ipc:///path")
    _check_cache_url(config.cache_url)
    _check_llm_url(config)
    _check_llm_transport(config)
    if config.otlp_endpoint is not None and not re.match(r"^https?://[^/]+", config.otlp_endpoint):
        raise ConfigError(
            f"--otlp_endpoint {config.otlp_endpoint!r} must be an http(s) URL, e.g. http://127.0.0.1:4318"
        )


def _check_llm_url(config: Config) -> None:
    url = config.llm_url
    if url is None:
        return
    if not re.match(r"^https?://[^/?#]+(/[^?#]*)?$", url):  # may hold user:password: never echoed
        raise ConfigError("--llm_url must be the LLM server's base URL, http(s)://HOST:PORT[/PREFIX]")
    if config.llm_endpoint is not None:
        raise ConfigError(
            "--llm_url and --llm_endpoint are two ways to hand embeddings to an LLM server; set one of them"
        )


def _check_llm_transport(config: Config) -> None:
    """ec_storage needs the LLM server (--llm_url) and the directory it reads (preflight checks that it is
    writable and that the family's vLLM parser takes metadata-only parts)."""
    if config.llm_transport not in ("inline", "ec_storage"):
        raise ConfigError(f"--llm_transport {config.llm_transport!r} is not one of inline, ec_storage")
    if config.llm_transport == "inline":
        if config.ec_storage_path is not None:
            raise ConfigError("--ec_storage_path is used only with --llm_transport ec_storage")
        return
    if config.llm_url is None:
        raise ConfigError("--llm_transport ec_storage hands embeddings to the LLM server: set --llm_url")
    if config.ec_storage_path is None:
        raise ConfigError(
            "--llm_transport ec_storage needs --ec_storage_path DIR, the vLLM consumer's shared_storage_path"
        )


def _check_cache_url(url: str | None) -> None:
    if url is None:
        return
    if not re.match(r"^rediss?://[^/]", url):  # the URL may hold a password: never echoed
        raise ConfigError("--cache_url must be redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
    if importlib.util.find_spec("redis") is None:
        raise ConfigError("--cache_url needs the Redis client: pip install 'vitserve[redis]'")
