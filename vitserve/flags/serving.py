"""The flags of the HTTP service around the encoder: where it listens, its output cache (local and shared),
who may call it and fetch what, and its logs and traces."""

from __future__ import annotations

import importlib.util
import re

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags.spec import Flag, check_positive, optional, parse_bool, parse_domains, parse_int

SERVER: dict[str, Flag] = {
    "host": Flag(str, "server", "HTTP bind address"),
    "port": Flag(parse_int, "server", "HTTP port"),
}
CACHE: dict[str, Flag] = {
    "cache_gb": Flag(float, "cache", "encoder-output cache size; 0 disables"),
    "cache_url": Flag(
        optional(str),
        "cache",
        "shared cache for replicas: redis://[:PASSWORD@]HOST:PORT/DB or rediss:// (TLS); none: off",
    ),
    "cache_ttl_s": Flag(float, "cache", "TTL of shared-cache entries; 0: none (Redis's maxmemory evicts)"),
}
SECURITY: dict[str, Flag] = {
    "api_key": Flag(
        optional(str), "security", "require 'Authorization: Bearer KEY' on every route but /health"
    ),
    "allow_image_urls": Flag(parse_bool, "security", "accept {'url': ...} images (SSRF-guarded)"),
    "allowed_url_domains": Flag(
        parse_domains, "security", "comma-separated domains URL images may come from"
    ),
}
LOGGING: dict[str, Flag] = {
    "log_level": Flag(str, "logging", "debug | info | warning | error"),
    "otlp_endpoint": Flag(
        optional(str),
        "logging",
        "OTLP/HTTP collector for /encode spans, e.g. http://127.0.0.1:4318 (docs/tracing.md); none: off",
    ),
}


def validate(config: Config) -> None:
    check_positive(config, "cache_gb", "cache_ttl_s", allow_zero=True)
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {config.port}")
    if config.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"--log_level {config.log_level!r} is not one of debug, info, warning, error")
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
