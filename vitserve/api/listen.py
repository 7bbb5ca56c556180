"""The HTTP socket, bound by the CLI before anything slow is imported (this module is light).

Bound, not yet listening: asyncio's create_server calls listen() when uvicorn starts serving it. Until then a
connection is refused, as when nothing is bound; a listening socket would queue it unanswered for the API's
~7 s of imports, and a client that gave up would still have its request answered, and counted, later.
"""

from __future__ import annotations

import socket

from vitserve.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    """The socket, bound before anything slow starts, so a busy port fails fast naming --port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, socktype, proto, _, addr = infos[0]
        # The proto from getaddrinfo (IPPROTO_TCP), not 0: asyncio sets TCP_NODELAY on accepted connections
        # only when the listening socket's proto is IPPROTO_TCP. Without it, Nagle held each response body
        # (uvicorn writes headers and body separately) until the client's delayed ACK: ~40 ms per response.
        sock = socket.socket(family, socktype, proto or socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); change --host/--port"
        ) from exc
    sock.setblocking(False)
    return sock
