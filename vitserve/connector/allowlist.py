"""Who the connector may pull from (SPEC §13; vitserve/connector/fetch.py uses it): `pull_from`, the connector's
extra config, as hosts or CIDRs; loopback only by default.

A host name is admitted only when listed itself, matched case-insensitively: no DNS lookup on vLLM's scheduler
thread, so a producer that advertises a name must be listed by that name. An IP address is admitted when a listed
network holds it (a bare IP is a /32 or /128); `0.0.0.0/0` admits any. `ipc://` is admitted when loopback is
(it never leaves the host). A bind address (`0.0.0.0`, `::`, `*`) is never a producer: it says where a replica
listens, not where it is reached.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

DEFAULT_PULL_FROM = ("127.0.0.0/8", "::1", "localhost")
DEFAULT_ACCEPT_FROM = DEFAULT_PULL_FROM  # who may push with wire_security tag when accept_from is not given


class Allowlist:
    """`pull_from` (or `accept_from`, who may push with wire_security tag) parsed: IP networks and host names."""

    def __init__(self, entries: Iterable[str], name: str = "pull_from") -> None:
        self.name = name
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.names: set[str] = set()
        for entry in entries:
            text = str(entry).strip()
            try:
                network = ipaddress.ip_network(text, strict=False)
            except ValueError:
                if not text or "/" in text or text == "*":
                    raise ValueError(f"{name} entry {entry!r} is neither a host nor a CIDR") from None
                self.names.add(text.lower())
                continue
            if "/" not in text and network.network_address.is_unspecified:  # 0.0.0.0 is a bind, not a host
                raise ValueError(f"{name} entry {entry!r} is neither a host nor a CIDR (0.0.0.0/0: any)")
            self.networks.append(network)
        self.entries = tuple(entries)

    def refuses(self, endpoint: str) -> str | None:
        """Why `endpoint` may not be fetched from, or None when it is admitted."""
        scheme, sep, rest = endpoint.partition("://")
        if scheme == "ipc" and sep:
            return (
                None
                if self._admits_host("127.0.0.1")
                else f"ipc:// is this host's, and {self.name} admits no loopback"
            )
        if scheme != "tcp" or not sep:
            return f"a producer is tcp://HOST:PORT (or ipc://), got {endpoint[:80]!r}"
        try:
            parts = urlsplit(f"//{rest}")
            host, port = parts.hostname or "", parts.port
        except ValueError:
            host, port = "", None
        if not host or port is None:
            return f"a producer is tcp://HOST:PORT, got {endpoint[:80]!r}"
        if host in ("0.0.0.0", "::", "*"):
            return f"{endpoint} is a bind address: the producer advertises where it is reached (--pull_advertise)"
        if not self._admits_host(host):
            return f"host {host} is not admitted by {self.name} {list(self.entries)}"
        return None

    def admits_peer(self, address: str) -> bool:
        """Whether a peer whose ZMTP handshake comes from `address` (an IP; empty over ipc://, which never leaves
        the host) is admitted. Names are not looked up: a peer is known by its address only."""
        if not address:
            return self._admits_host("127.0.0.1")
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.networks if network.version == ip.version)

    def _admits_host(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        return any(address in network for network in self.networks if network.version == address.version)
