"""Which ZMQ endpoints only this host can reach: the rule of the wire's protected mode (docs/vllm.md, "Security").
A keyless connector binds, and a keyless vitserve pushes to, only such an endpoint."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOCAL_SCHEMES = ("ipc", "inproc")  # a Unix socket or one process: never reachable from another host
# how the wire's secret keys it (vitserve --wire_security, the connector's wire_security): CURVE, or a tag per
# message with the bytes in clear (vitserve/rpc/tag.py)
WIRE_SECURITIES = ("curve", "tag")


def host_only(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address or `localhost`; False for anything else,
    `0.0.0.0`, `*`, a host name and an interface name included (they may face a network)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in LOCAL_SCHEMES:
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rank_endpoint(endpoint: str, index: int) -> str:
    """The endpoint of data-parallel engine core `index` when core 0's is `endpoint`, as vLLM's own Mooncake
    consumer offsets its port: tcp, the port + index; ipc (or another scheme), the path + "-index". Index 0, or a
    tcp port 0 (an ephemeral bind), is `endpoint` itself. The connector binds it (connector/config.py), vitserve
    --llm_transport wire --llm_dp_size pushes to it (handover/wire.py)."""
    if index == 0:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + index}" if port.isdigit() and int(port) else endpoint
    return f"{endpoint}-{index}"
