"""The connector's `ec_connector_extra_config`, checked once at vLLM's start (docs/vllm.md, the table of keys),
and the store it starts: no vLLM here, so the same code runs in tests without it.

A wrong value stops vLLM's start with one line naming the key, what it must be and what it got. A keyless
endpoint that another host could reach is refused by the store (protected mode, docs/vllm.md "Security") unless
`allow_unauthenticated` is true.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vitserve.connector.allowlist import DEFAULT_ACCEPT_FROM, Allowlist
from vitserve.connector.store import EmbeddingStore, Shape
from vitserve.endpoints import WIRE_SECURITIES, rank_endpoint
from vitserve.rpc.wirekey import read_key_file

DEFAULT_MAX_GB = 4.0
DEFAULT_WAIT_S = 5.0
KEY = "ec_connector_extra_config"
KNOWN = (
    "endpoint",
    "max_gb",
    "key_file",
    "wait_s",
    "shm_dir",
    "max_hold_s",
    "allow_unauthenticated",
    "pull_from",
    "dp_push",
    "wire_security",
    "accept_from",
)


@dataclass(frozen=True)
class ConnectorConfig:
    endpoint: str | None  # None: pull only (vitserve --llm_transport pull), nothing bound
    max_gb: float = DEFAULT_MAX_GB
    key_file: str | None = None
    wait_s: float = DEFAULT_WAIT_S
    shm_dir: str | None = None
    max_hold_s: float | None = None  # None: the store's default
    allow_unauthenticated: bool = False
    # the producers a pull may fetch from (allowlist.py); None: not given, this host's only (DEFAULT_PULL_FROM)
    pull_from: tuple[str, ...] | None = None
    # data parallel: vitserve --llm_transport wire --llm_dp_size N pins each request to a core and pushes to
    # that core's endpoint (for_rank), so a core past the first may bind one
    dp_push: bool = False
    # how key_file keys the bound endpoint: "curve" (ZMQ CURVE, encrypted) or "tag" (a tag per message, in clear,
    # senders admitted by address: accept_from; docs/vllm.md "Security"); pulls key with CURVE either way
    wire_security: str = "curve"
    accept_from: tuple[str, ...] | None = None  # wire_security tag's senders; None: this host's only

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * 2**30)


def parse_config(extra: Mapping[str, Any]) -> tuple[ConnectorConfig, list[str]]:
    """The config, and the keys it does not know (a typo, or a later version's): ValueError when a value is
    wrong."""
    endpoint = extra.get("endpoint")
    if endpoint is not None and (not isinstance(endpoint, str) or not endpoint):
        raise ValueError(
            f"{KEY}.endpoint must be the ZMQ address the connector binds for vitserve --llm_transport wire, e.g. "
            f"tcp://127.0.0.1:5600, or left out (--llm_transport pull binds nothing); not {endpoint!r}"
        )
    config = ConnectorConfig(
        endpoint=endpoint,
        max_gb=_positive(extra, "max_gb", DEFAULT_MAX_GB),
        key_file=_text(extra, "key_file"),
        wait_s=_positive(extra, "wait_s", DEFAULT_WAIT_S),
        shm_dir=_text(extra, "shm_dir"),
        max_hold_s=_positive(extra, "max_hold_s", None),
        allow_unauthenticated=_flag(extra, "allow_unauthenticated"),
        pull_from=_hosts(extra, "pull_from"),
        dp_push=_flag(extra, "dp_push"),
        **_security(extra),
    )
    return config, sorted(k for k in extra if k not in KNOWN)


def _hosts(extra: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f'{KEY}.{key} must be a list of networks or host names, e.g. ["10.0.0.0/8"], not {value!r}'
        )
    try:
        Allowlist(tuple(value), key)
    except ValueError as exc:
        raise ValueError(f"{KEY}.{key}: {exc}") from None
    return tuple(value)


def _security(extra: Mapping[str, Any]) -> dict[str, Any]:
    security = extra.get("wire_security", "curve")
    if security not in WIRE_SECURITIES:
        raise ValueError(f"{KEY}.wire_security must be one of {', '.join(WIRE_SECURITIES)}, not {security!r}")
    if security == "tag" and not extra.get("key_file"):
        raise ValueError(f"{KEY}.wire_security tag tags each message with key_file's secret: set key_file")
    accept_from = _hosts(extra, "accept_from")
    if accept_from is not None and security != "tag":
        raise ValueError(
            f"{KEY}.accept_from admits senders by address for wire_security tag (CURVE admits by key): set "
            '"wire_security": "tag", or leave accept_from out'
        )
    return {"wire_security": security, "accept_from": accept_from}


def for_rank(config: ConnectorConfig, index: int, local_index: int | None = None) -> ConnectorConfig:
    """The config of data-parallel engine core `index` (vLLM's parallel_config.data_parallel_index; one
    connector per engine core, each in its own process; `local_index` its data_parallel_rank_local): a push
    endpoint offset by the index (vitserve/endpoints.py `rank_endpoint`), as vLLM's own Mooncake consumer does.

    A push endpoint on a core past the first needs `dp_push` (vitserve --llm_transport wire --llm_dp_size N pins
    each request to a core with vLLM's X-data-parallel-rank header and pushes to that core's endpoint): without
    it vitserve pushes to one endpoint and cannot choose which core gets a request, so the others' requests would
    fail. A core on another node than the first (`local_index` != `index`: a multi-node vLLM) cannot take pushes
    at all: vitserve reaches every rank at --llm_endpoint's host. Both are refused, naming pull, which needs
    neither."""
    if config.endpoint is None:
        return config
    pull = (
        f"leave out {KEY}.endpoint and run vitserve with --llm_transport pull (each core fetches what its "
        'requests name; docs/vllm.md, "Pull")'
    )
    if index > 0 and local_index is not None and local_index != index:
        raise ValueError(
            f"this vLLM runs data-parallel engine cores on more than one node (this is #{index}, #{local_index} "
            f"on its node), and vitserve pushes to every core at one host: {pull}"
        )
    if index > 0 and not config.dp_push:
        raise ValueError(
            f"this vLLM runs data-parallel engine cores (this is #{index}), and vitserve --llm_transport wire "
            f"pushes to one endpoint without knowing which core gets a request: {pull}; or set {KEY}.dp_push "
            "true and run vitserve with --llm_dp_size N (N the --data-parallel-size), which pins each request to "
            'a core and pushes to its endpoint (port + its index; docs/vllm.md, "Push to data-parallel cores")'
        )
    return replace(config, endpoint=rank_endpoint(config.endpoint, index))


def _positive(extra: Mapping[str, Any], key: str, default: float | None) -> Any:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{KEY}.{key} must be a number > 0, not {value!r}")
    return float(value)


def _text(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{KEY}.{key} must be a path, not {value!r}")
    return value


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{KEY}.{key} must be true or false (JSON), not {value!r}")
    return value


def start_store(
    config: ConnectorConfig, shape: Shape, log: logging.Logger, dtype: str = ""
) -> EmbeddingStore:
    """Bind the connector's receiver as `config` says (raises what the store raises: ValueError for a keyless
    endpoint another host could reach without allow_unauthenticated, OSError for a bind that fails)."""
    key = read_key_file(config.key_file) if config.key_file else None
    kwargs: dict[str, Any] = {"key": key, "directory": config.shm_dir, "log": log, "dtype": dtype}
    if config.max_hold_s is not None:
        kwargs["max_hold_s"] = config.max_hold_s
    kwargs["allow_unauthenticated"] = config.allow_unauthenticated
    if config.wire_security == "tag":
        kwargs["accept_from"] = Allowlist(config.accept_from or DEFAULT_ACCEPT_FROM, "accept_from")
    return EmbeddingStore(config.endpoint, config.max_bytes, shape, **kwargs)
