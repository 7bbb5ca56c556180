"""The one start-up table of the hand-over to the LLM server: every --llm_transport value's start-up facts.

Each transport is one `TransportSpec` subclass here, light (no torch, no zmq, no HTTP: the CLI checks the
flags before it imports any of them), and its `Transport` in vitserve/handover/ extends it, so the class that
hands embeddings over is the class that answers:

- `check_flags(config)`: what the flags alone must say for it (vitserve/flags/handoff.py runs it; a flag of
  another transport's `flags` is refused there, naming the transport it belongs to);
- `preflight(config, family)`: its refusals once the checkpoint is open, before any rank (preflight.py);
- `banner` and `info(config)`: its line of the start-up banner and its keys of /v1/info (api/info.py);
- `owns_llm_endpoint`: whether --llm_endpoint names its own peer (vitserve's vLLM connector) rather than the
  /encode push's receiver (engine/engine.py starts that push only when the transport does not own it);
- `readiness()` (on the `Transport`, handover/base.py): why /ready says 503 for it while serving.

The engine, the API, preflight.py and the flags name no transport: they ask `spec_of(config)` or walk
`SPECS` (tests/unit/test_transport_names.py). Adding a transport is a spec here, one line in `SPECS`, and its
module in vitserve/handover/ with one line in handover/transports.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, ClassVar

from vitserve.config import Config
from vitserve.endpoints import WIRE_SECURITIES, host_only, rank_endpoint
from vitserve.errors import ConfigError
from vitserve.families import Family


class TransportSpec:
    """A transport's start-up facts; the base is what a transport that needs nothing of them says."""

    name: ClassVar[str]  # its --llm_transport value
    help: ClassVar[str]  # what --llm_transport's help says of it
    flags: ClassVar[tuple[str, ...]] = ()  # flags only this transport uses (refused with another one)
    owns_llm_endpoint: ClassVar[bool] = False  # --llm_endpoint names this transport's peer
    banner: ClassVar[tuple[str, tuple[str, ...]] | None] = None  # its banner line: a label and its info keys

    @classmethod
    def check_flags(cls, config: Config) -> None:
        """Refuse what the flags alone tell cannot work with this transport (ConfigError naming the flag)."""
        return

    @classmethod
    def preflight(cls, config: Config, family: Family) -> None:
        """Refuse, once the checkpoint is open and before any rank, what can never serve with this transport."""
        return

    @classmethod
    def info(cls, config: Config) -> dict[str, Any]:
        """Its settings in /v1/info (the keys of `banner`); given whichever transport serves, so the body's
        keys never change."""
        return {}


class InlineSpec(TransportSpec):
    name = "inline"
    help = "embeddings in the JSON body to --llm_url"


class _MetadataParts(TransportSpec):
    """A transport that sends metadata-only parts naming each item by uuid, loaded by the LLM server's
    connector: it needs --llm_url, and a family whose vLLM parser takes such a part."""

    @classmethod
    def check_flags(cls, config: Config) -> None:
        if config.llm_url is None:
            raise ConfigError(f"--llm_transport {cls.name} hands embeddings to the LLM server: set --llm_url")

    @classmethod
    def preflight(cls, config: Config, family: Family) -> None:
        if family.layout == "tiles":
            raise ConfigError(
                f"--llm_transport {cls.name} cannot serve {family.name}: vLLM takes its image embeddings only "
                f"as a bare tensor, with no metadata-only form; use --llm_transport {InlineSpec.name}"
            )


class EcStorageSpec(_MetadataParts):
    name = "ec_storage"
    help = "written to --ec_storage_path for a vLLM encoder-cache consumer (a metadata-only part)"
    flags = ("ec_storage_path",)
    banner = ("encoder cache", ("ec_storage_path", "ec_ttl_s", "ec_storage_gb"))

    @classmethod
    def check_flags(cls, config: Config) -> None:
        super().check_flags(config)
        if config.ec_storage_path is None:
            raise ConfigError(
                f"--llm_transport {cls.name} needs --ec_storage_path DIR, the vLLM consumer's shared_storage_path"
            )

    @classmethod
    def preflight(cls, config: Config, family: Family) -> None:
        """A directory this process can create files in (made if missing)."""
        super().preflight(config, family)
        path = Path(config.ec_storage_path or "")
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".vitserve-probe-"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"--ec_storage_path {path} is not a writable directory ({exc.strerror or exc}); give the "
                "directory the vLLM consumer reads (its shared_storage_path)"
            ) from None

    @classmethod
    def info(cls, config: Config) -> dict[str, Any]:
        return {
            "ec_storage_path": config.ec_storage_path,  # the vLLM consumer's shared_storage_path
            "ec_ttl_s": config.ec_ttl_s,
            "ec_storage_gb": config.ec_storage_gb,
        }


class WireSpec(_MetadataParts):
    name = "wire"
    help = "pushed to vitserve's vLLM connector at --llm_endpoint (a metadata-only part)"
    flags = ("wire_key_file", "wire_security", "llm_dp_size")
    banner = ("wire", ("llm_dp_size",))
    owns_llm_endpoint = True

    @classmethod
    def check_flags(cls, config: Config) -> None:
        super().check_flags(config)
        if config.llm_endpoint is None:
            raise ConfigError(
                f"--llm_transport {cls.name} needs --llm_endpoint tcp://HOST:PORT, where vitserve's vLLM "
                "connector listens"
            )
        # The wire's protected mode (docs/vllm.md, "Security"): embeddings go unkeyed only to an endpoint no other
        # host can reach, as the connector binds unkeyed only such an endpoint.
        if config.wire_key_file is None and not host_only(config.llm_endpoint):
            raise ConfigError(
                f"--llm_endpoint {config.llm_endpoint} is reachable from other hosts: --llm_transport {cls.name} "
                "needs --wire_key_file there (the connector's key_file), or an endpoint on this host "
                "(tcp://127.0.0.1:PORT, ipc://PATH)"
            )
        _check_dp_size(config.llm_endpoint, config.llm_dp_size)
        _check_security(config.wire_security, config.wire_key_file)

    @classmethod
    def info(cls, config: Config) -> dict[str, Any]:
        """vLLM's data-parallel engine cores vitserve pushes to (one sender each); null unless wire."""
        return {"llm_dp_size": (config.llm_dp_size or 1) if config.llm_transport == cls.name else None}

    @classmethod
    def preflight(cls, config: Config, family: Family) -> None:
        """A key file this process can read (its contents are the connector's shared secret: never logged)."""
        super().preflight(config, family)
        _readable_key(config)


def _check_security(security: str | None, key_file: str | None) -> None:
    if security is None:
        return
    if security not in WIRE_SECURITIES:
        raise ConfigError(f"--wire_security must be one of {', '.join(WIRE_SECURITIES)}, not {security!r}")
    if security == "tag" and key_file is None:
        raise ConfigError(
            "--wire_security tag tags each message with the connector's secret: set --wire_key_file"
        )


class PullSpec(_MetadataParts):
    name = "pull"
    help = (
        "kept here and fetched by vitserve's vLLM connector from --pull_bind (announced at --pull_advertise; "
        "a metadata-only part)"
    )
    flags = ("wire_key_file", "pull_bind", "pull_advertise")
    banner = ("pull producer", ("pull_bind", "pull_advertise", "pull_store_gb"))

    @classmethod
    def check_flags(cls, config: Config) -> None:
        super().check_flags(config)
        bind = config.pull_bind
        if bind is None or not bind.startswith("tcp://") or ":" not in bind[len("tcp://") :]:
            raise ConfigError(
                f"--llm_transport {cls.name} needs --pull_bind tcp://HOST:PORT, where vLLM's connector fetches "
                f"the embeddings (got {bind!r})"
            )
        if config.pull_advertise is None and not _concrete(bind):
            raise ConfigError(
                f"--pull_bind {bind} binds every interface: set --pull_advertise tcp://NAME:PORT, the address vLLM "
                "reaches this replica at (announced with each item)"
            )
        advertise = config.pull_advertise or bind
        if not advertise.startswith("tcp://") or not _concrete(advertise):
            raise ConfigError(
                f"--pull_advertise {advertise!r} must be tcp://HOST:PORT with a host vLLM can reach (not 0.0.0.0 or *)"
            )
        # the wire's protected mode: embeddings go unkeyed only from an endpoint no other host can reach
        if config.wire_key_file is None and not host_only(bind):
            raise ConfigError(
                f"--pull_bind {bind} is reachable from other hosts: --llm_transport {cls.name} needs "
                "--wire_key_file there (the connector's key_file), or a bind on this host (tcp://127.0.0.1:PORT)"
            )

    @classmethod
    def preflight(cls, config: Config, family: Family) -> None:
        super().preflight(config, family)
        _readable_key(config)

    @classmethod
    def info(cls, config: Config) -> dict[str, Any]:
        pulling = config.llm_transport == cls.name
        return {
            "pull_bind": config.pull_bind,
            "pull_advertise": (config.pull_advertise or config.pull_bind) if pulling else None,
            "pull_store_gb": config.pull_store_gb,
        }


def _check_dp_size(endpoint: str, size: int | None) -> None:
    """--llm_dp_size: at least 1 engine core, each at --llm_endpoint + its rank (a tcp port in range)."""
    if size is None:
        return
    if size < 1:
        raise ConfigError(
            f"--llm_dp_size must be >= 1, vLLM's --data-parallel-size (its engine cores), got {size}"
        )
    last = rank_endpoint(endpoint, size - 1)
    port = last.rpartition(":")[2] if last.startswith("tcp://") else ""
    if port.isdigit() and int(port) > 65535:
        raise ConfigError(
            f"--llm_dp_size {size}: engine core {size - 1}'s connector would be at {last}, past port 65535; "
            "give --llm_endpoint a lower port"
        )
    if size > 1 and last == endpoint:
        raise ConfigError(
            f"--llm_dp_size {size} needs --llm_endpoint with a port (each core's connector is at port + its rank), "
            f"not {endpoint}"
        )


def _concrete(endpoint: str) -> bool:
    """A tcp:// endpoint whose host names one address (not every interface)."""
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    return host not in ("", "*", "0.0.0.0", "::")


def _readable_key(config: Config) -> None:
    """--wire_key_file, when set, is a file this process can read (never logged)."""
    if config.wire_key_file is None:
        return
    try:
        Path(config.wire_key_file).read_bytes()  # its length is checked where it is read (rpc/wirekey.py)
    except OSError as exc:
        raise ConfigError(
            f"--wire_key_file {config.wire_key_file} cannot be read ({exc.strerror or exc}); give the file "
            "that holds the connector's key_file secret"
        ) from None


# The table, by --llm_transport value, in --help's order.
SPECS: dict[str, type[TransportSpec]] = {
    spec.name: spec for spec in (InlineSpec, EcStorageSpec, WireSpec, PullSpec)
}


def spec_of(config: Config) -> type[TransportSpec]:
    """The start-up facts of the transport --llm_transport names (the flags checked the name)."""
    return SPECS[config.llm_transport]


def transports_info(config: Config) -> dict[str, Any]:
    """Every transport's /v1/info keys, in the table's order."""
    return {key: value for spec in SPECS.values() for key, value in spec.info(config).items()}
