"""Listening sockets of given processes, read from /proc/net/tcp{,6} (docs/design.md invariant 15) — no tools needed."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir) if os.path.isdir(fd_dir) else []:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0])))
    words = struct.unpack("<4I", raw)  # the kernel prints IPv6 as four host-order 32-bit words
    return str(ipaddress.IPv6Address(b"".join(struct.pack(">I", socket.htonl(w)) for w in words)))


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids`."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:
                    hex_ip, hex_port = local.split(":")
                    found.append((_addr(hex_ip), int(hex_port, 16)))
    return found


def children_of(pid: int) -> list[int]:
    """Every descendant pid (via /proc/*/stat ppid)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out
