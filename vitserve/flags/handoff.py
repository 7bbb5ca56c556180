"""The flags of the hand-over to an LLM server: the ZMQ endpoint, or the OpenAI-compatible server vitserve
fronts (/v1/chat/completions) and the transport its embeddings take (docs/vllm.md): inline, ec_storage's
directory, or wire to vitserve's vLLM connector (--llm_endpoint then names the connector)."""

from __future__ import annotations

import re

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags.spec import Flag, check_positive, optional
from vitserve.rpc.endpoints import host_only

HANDOFF: dict[str, Flag] = {
    "llm_endpoint": Flag(
        optional(str),
        "LLM handoff",
        "ZMQ endpoint of the LLM server (tcp://host:port or ipc:///path), or with --llm_transport wire of "
        "vitserve's vLLM connector; none: inline only",
    ),
    "llm_url": Flag(
        optional(str),
        "LLM handoff",
        "OpenAI-compatible LLM server (vLLM with --enable-mm-embeds), http://host:port: serves "
        "/v1/chat/completions in front of it (docs/vllm.md); none: off",
    ),
    "llm_api_key": Flag(
        optional(str), "LLM handoff", "sent to --llm_url as 'Authorization: Bearer KEY' (never logged)"
    ),
    "llm_timeout_s": Flag(float, "LLM handoff", "deadline for one completion from --llm_url (502/504 after)"),
    "llm_transport": Flag(
        str,
        "LLM handoff",
        "inline | ec_storage | wire: embeddings in the JSON body to --llm_url, written to --ec_storage_path "
        "for a vLLM encoder-cache consumer, or pushed to vitserve's vLLM connector at --llm_endpoint; the "
        "last two send a metadata-only part (docs/vllm.md)",
    ),
    "wire_key_file": Flag(
        optional(str),
        "LLM handoff",
        "file holding the vLLM connector's key_file secret (wire only; never shown)",
    ),
    "ec_storage_path": Flag(
        optional(str), "LLM handoff", "the vLLM EC consumer's shared_storage_path (ec_storage only)"
    ),
    "ec_ttl_s": Flag(float, "LLM handoff", "an encoder-cache file no request uses is removed after this"),
    "ec_storage_gb": Flag(
        float, "LLM handoff", "bound on the encoder-cache files' bytes; least recently used go first"
    ),
}


def validate(config: Config) -> None:
    check_positive(config, "llm_timeout_s", "ec_ttl_s", "ec_storage_gb")
    if config.llm_endpoint is not None and not re.match(r"^(tcp|ipc)://.+", config.llm_endpoint):
        raise ConfigError(f"--llm_endpoint {config.llm_endpoint!r} must be tcp://host:port or ipc:///path")
    _check_llm_url(config)
    _check_llm_transport(config)


def _check_llm_url(config: Config) -> None:
    url = config.llm_url
    if url is None:
        return
    if not re.match(r"^https?://[^/?#]+(/[^?#]*)?$", url):  # may hold user:password: never echoed
        raise ConfigError("--llm_url must be the LLM server's base URL, http(s)://HOST:PORT[/PREFIX]")
    if config.llm_endpoint is not None and config.llm_transport != "wire":
        raise ConfigError(
            "--llm_url and --llm_endpoint are two ways to hand embeddings to an LLM server; set one of them "
            "(or both with --llm_transport wire, where --llm_endpoint is vitserve's vLLM connector)"
        )


def _check_llm_transport(config: Config) -> None:
    """ec_storage needs the LLM server (--llm_url) and the directory it reads, wire the LLM server and its
    connector (--llm_endpoint); preflight checks the directory, the key file and the family."""
    transport = config.llm_transport
    if transport not in ("inline", "ec_storage", "wire"):
        raise ConfigError(f"--llm_transport {transport!r} is not one of inline, ec_storage, wire")
    if transport != "ec_storage" and config.ec_storage_path is not None:
        raise ConfigError("--ec_storage_path is used only with --llm_transport ec_storage")
    if transport != "wire" and config.wire_key_file is not None:
        raise ConfigError("--wire_key_file is used only with --llm_transport wire")
    if transport == "inline":
        return
    if config.llm_url is None:
        raise ConfigError(f"--llm_transport {transport} hands embeddings to the LLM server: set --llm_url")
    if transport == "wire" and config.llm_endpoint is None:
        raise ConfigError(
            "--llm_transport wire needs --llm_endpoint tcp://HOST:PORT, where vitserve's vLLM connector listens"
        )
    if transport == "ec_storage" and config.ec_storage_path is None:
        raise ConfigError(
            "--llm_transport ec_storage needs --ec_storage_path DIR, the vLLM consumer's shared_storage_path"
        )
    if transport == "wire":
        _check_protected(config)


def _check_protected(config: Config) -> None:
    """The wire's protected mode (docs/vllm.md, "Security"): embeddings go unkeyed only to an endpoint no other
    host can reach, as the connector binds unkeyed only such an endpoint."""
    endpoint = config.llm_endpoint or ""
    if config.wire_key_file is None and not host_only(endpoint):
        raise ConfigError(
            f"--llm_endpoint {endpoint} is reachable from other hosts: --llm_transport wire needs --wire_key_file "
            "there (the connector's key_file), or an endpoint on this host (tcp://127.0.0.1:PORT, ipc://PATH)"
        )
