"""The `vitserve` entry point: flags + VITSERVE_* environment -> one frozen Config -> Service.run().

This is the only place that reads the environment (docs/api.md): each flag also reads VITSERVE_<FLAG_UPPER>
(the flag wins), VITSERVE_RUNTIME_DIR sets the runtime directory, and torchrun's environment (MASTER_ADDR,
MASTER_PORT, GROUP_RANK, WORLD_SIZE, ...: preflight.torchrun_values) fills the node flags no flag set.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import vitserve
from vitserve import preflight
from vitserve.config import Config
from vitserve.errors import ConfigError, VitserveError
from vitserve.families import FAMILY_CHOICES
from vitserve.metrics import Metrics

if TYPE_CHECKING:  # imported lazily below: the server pulls in uvicorn, torch and transformers
    from vitserve.api.server import Service

log = logging.getLogger("vitserve")
T = TypeVar("T")
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
    "visual_reserved_mem_gb": Flag(
        _optional(float),
        "budget and limits",
        "skip the start-up stress and reserve this much",
        "none (measure at start-up)",
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
    "request_timeout_s": Flag(float, "budget and limits", "end-to-end deadline (504 after it)"),
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
        "request_timeout_s",
        "heartbeat_s",
        "dist_timeout_s",
    )
    _positive(
        config,
        "visual_batch_max_tokens",
        "max_queue_tokens",
        "cache_gb",
        "cache_ttl_s",
        "visual_reserved_mem_gb",
        "node_rank",
        allow_zero=True,
    )
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {config.port}")
    if config.model_family not in FAMILY_CHOICES:
        raise ConfigError(f"--model_family {config.model_family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {config.dtype!r} is not one of auto, float32, bfloat16, float16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f"--device {config.device!r} is not one of auto, cpu, cuda, cuda:N")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"--log_level {config.log_level!r} is not one of debug, info, warning, error")
    if config.llm_endpoint is not None and not re.match(r"^(tcp|ipc)://.+", config.llm_endpoint):
        raise ConfigError(f"--llm_endpoint {config.llm_endpoint!r} must be tcp://host:port or ipc:///path")
    _check_cache_url(config.cache_url)
    if config.otlp_endpoint is not None and not re.match(r"^https?://[^/]+", config.otlp_endpoint):
        raise ConfigError(
            f"--otlp_endpoint {config.otlp_endpoint!r} must be an http(s) URL, e.g. http://127.0.0.1:4318"
        )


def _check_cache_url(url: str | None) -> None:
    if url is None:
        return
    if not re.match(r"^rediss?://[^/]", url):  # the URL may hold a password: never echoed
        raise ConfigError("--cache_url must be redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
    if importlib.util.find_spec("redis") is None:
        raise ConfigError("--cache_url needs the Redis client: pip install 'vitserve[redis]'")


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def _resolved_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def render_banner(service: Service) -> str:
    """One block with every resolved setting that guards memory or load (docs/api.md)."""
    from vitserve.engine.cache import redacted_url

    c: Config = service.config
    info = service.engine.info()
    reserved = info.reserved_memory_bytes
    per_rank = ", ".join(f"rank {r}: {_mib(b)}" for r, b in sorted(reserved.items())) or "unknown"
    budget = f"{c.budget_tokens} tokens per batch and per image" if c.budget_enabled else "OFF (no clamp)"
    lines = [
        f"vitserve {__import__('vitserve').__version__} serving on http://{c.host}:{service.port}",
        f"  model: {info.model} (family {info.family}, dim {info.embed_dim}, "
        f"dtype {info.dtype}, device {_resolved_device(c.device)})",
        f"  budget: {budget}; at most {c.max_batch_images} images per batch",
        f"  processor clamp: {service.processor.clamp_info()}",
        f"  layout: tp={info.tp} dp={info.dp}",
        f"  reserved memory per rank: {per_rank} (source: {info.reserved_source})",
        f"  queue: max_queue_tokens={c.queue_token_limit or 'unlimited'}; request: "
        f"max_images_per_request={c.max_images_per_request}, max_request_bytes={c.max_request_bytes}, "
        f"max_image_pixels={c.max_image_pixels}, request_timeout_s={c.request_timeout_s}",
        f"  llm_endpoint: {c.llm_endpoint or 'none (inline only)'}; api_key: {'set' if c.api_key else 'none'}; "
        f"image URLs: {'on for ' + ','.join(c.allowed_url_domains) if c.allow_image_urls else 'off'}",
        f"  cache: {f'{c.cache_gb:g} GiB' if c.cache_gb > 0 else 'off'} (in-flight dedup always on); "
        f"shared: {redacted_url(c.cache_url) if c.cache_url else 'off'}; "
        f"jpeg_draft: {'on' if c.jpeg_draft else 'off'}",
        "  output: NOT exact: --jpeg_draft is on (docs/jpeg_draft.md)"
        if c.jpeg_draft
        else "  output: exact (matches transformers)",
    ]
    return "\n".join(lines)


def _build_service(config: Config) -> Service:
    from vitserve.api.server import Service, bind_socket, warmup_image
    from vitserve.processors import load_image_processor

    processor = load_image_processor(
        config.model, budget_tokens=config.budget_tokens, family=config.model_family
    )
    preflight.check_processor_budget(config.budget_tokens, processor.clamp_info())
    sock = bind_socket(config.host, config.port)
    from vitserve.engine import Engine  # heavy (zmq, workers): only once the cheap checks passed

    metrics = Metrics()
    engine = Engine(
        config,
        metrics,
        processor_clamp=processor.clamp_info(),  # the clamp keys the cache
        warmup_image=warmup_image(processor),
    )
    return Service(config, engine, processor, metrics, sock=sock, banner=render_banner)


def _exit_now(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT before the service's event loop takes the signals over: no rank exists yet and the
    listening socket closes with the process, so leave at once. Raising instead would unwind through
    whatever import is running, and libraries that catch broad exceptions around their imports then carry
    on (seen: start-up continuing after SIGTERM, numpy imported twice)."""
    os.write(2, f"vitserve: stopped by {signal.Signals(signum).name} during start-up\n".encode())
    os._exit(128 + signum)


def install_stop_handlers() -> None:
    """First thing in main: a stop request ends start-up at any moment (imports, reading the checkpoint),
    not only once the event loop runs; as PID 1 in a container a signal without a handler is ignored."""
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_now)


def main(argv: list[str] | None = None) -> int:
    """Exit codes (docs/api.md): 0 stopped after serving; 1 start-up failed in the ranks or no encoder group
    is left (on a node > 0: node 0 went away); 2 a setting that can never work; 128 + N stopped by signal N
    before serving (130, 143)."""
    install_stop_handlers()
    try:
        config = build_config(argv, os.environ)
        # Encoder ranks inherit this. With the default (spinning) policy their idle OpenMP threads burn the
        # cores the API's preprocessing threads need: small images at 4 clients went 1.9 -> 9.9 img/s with
        # PASSIVE on 2 cores (bench/history/0.1.0.md, Serving, run 3). A value the user set is kept.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        logging.basicConfig(
            level=config.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        preflight.check(config)  # settings that can never serve exit 2 before anything slow
        from vitserve.worker import zygote  # light: the forkserver imports the heavy modules, not us

        zygote.start(config.model)  # the ranks' imports run beside ours from here on
        if config.node_rank > 0:  # ranks only: no HTTP, no processor, no queue (docs/engine.md, Nodes)
            from vitserve.engine.node import run_node
        else:
            service = _build_service(config)
    except (ConfigError, VitserveError, OSError) as exc:
        print(f"vitserve: start-up failed: {exc}", file=sys.stderr)
        return 2
    if config.node_rank > 0:
        return run_node(config, os.environ)
    return asyncio.run(service.run())


if __name__ == "__main__":
    raise SystemExit(main())
