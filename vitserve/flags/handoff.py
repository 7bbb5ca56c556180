"""The flags of the hand-over to an LLM server: the ZMQ endpoint, or the OpenAI-compatible server vitserve
fronts (/v1/chat/completions) and the transport its embeddings take (docs/vllm.md). What each transport needs
of them is its own (vitserve/transport_specs.py, the start-up table): this module names none."""

from __future__ import annotations

import re

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags.spec import Flag, check_positive, optional, parse_int
from vitserve.transport_specs import SPECS, spec_of

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
        " | ".join(SPECS) + ": " + "; ".join(f"{name}: {spec.help}" for name, spec in SPECS.items()),
    ),
    "wire_key_file": Flag(
        optional(str),
        "LLM handoff",
        "file holding the vLLM connector's key_file secret (wire only; never shown)",
    ),
    "wire_security": Flag(
        optional(str),
        "LLM handoff",
        "wire only: how --wire_key_file keys the wire, as the connector's wire_security: curve (ZMQ CURVE, "
        "encrypted) or tag (a tag per message, the bytes in clear: a private network; ~10x cheaper per byte)",
        "curve",
    ),
    "llm_dp_size": Flag(
        optional(parse_int),
        "LLM handoff",
        "wire only: vLLM's --data-parallel-size; each request is pinned to one engine core "
        "(X-data-parallel-rank) and pushed to that core's connector at --llm_endpoint + its rank",
        "1",
    ),
    "ec_storage_path": Flag(
        optional(str), "LLM handoff", "the vLLM EC consumer's shared_storage_path (ec_storage only)"
    ),
    "pull_bind": Flag(
        optional(str),
        "LLM handoff",
        "ZMQ endpoint vitserve's pull producer binds, tcp://HOST:PORT (pull only); vLLM's connector fetches there",
    ),
    "pull_advertise": Flag(
        optional(str),
        "LLM handoff",
        "the endpoint vLLM fetches from, announced per item (pull only; default --pull_bind; needed when "
        "--pull_bind is 0.0.0.0)",
    ),
    "pull_store_gb": Flag(
        float, "LLM handoff", "bound on the embeddings kept for vLLM to fetch (pull); a full store: 503"
    ),
    "ec_ttl_s": Flag(float, "LLM handoff", "an encoder-cache file no request uses is removed after this"),
    "ec_storage_gb": Flag(
        float, "LLM handoff", "bound on the encoder-cache files' bytes; least recently used go first"
    ),
}


def validate(config: Config) -> None:
    check_positive(config, "llm_timeout_s", "ec_ttl_s", "ec_storage_gb", "pull_store_gb")
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
    owners = [name for name, spec in SPECS.items() if spec.owns_llm_endpoint]
    if config.llm_endpoint is not None and not spec_of(config).owns_llm_endpoint:
        raise ConfigError(
            "--llm_url and --llm_endpoint are two ways to hand embeddings to an LLM server; set one of them "
            f"(or both with --llm_transport {' or '.join(owners)}, where --llm_endpoint is its peer)"
        )


def _check_llm_transport(config: Config) -> None:
    """A transport of the table, no flag of another transport, then what the transport itself needs of the
    flags (preflight checks the rest: the directory, the key file, the family)."""
    transport = config.llm_transport
    if transport not in SPECS:
        raise ConfigError(f"--llm_transport {transport!r} is not one of {', '.join(SPECS)}")
    own = spec_of(config).flags
    for flag in dict.fromkeys(f for spec in SPECS.values() for f in spec.flags):
        if flag not in own and getattr(config, flag) is not None:
            users = " or ".join(name for name, spec in SPECS.items() if flag in spec.flags)
            raise ConfigError(f"--{flag} is used only with --llm_transport {users}")
    spec_of(config).check_flags(config)
