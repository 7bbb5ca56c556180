"""Ports for servers the tests start: one free now, for a process that binds it only later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_picked: set[int] = set()


def unused_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that binds it only later (vLLM's HTTP port and its
    connector's endpoint, a minute into its start). Picked below the kernel's ephemeral range: a port there is
    never handed out by a bind to port 0 or an outgoing connection, which every vLLM and test makes by the
    hundred meanwhile (a port of that range, free when picked, was taken before vLLM bound it: its engine
    failed to start). Never the same one twice in a process."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10_000, max(low, 10_001))
        if port in _picked:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _picked.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")
