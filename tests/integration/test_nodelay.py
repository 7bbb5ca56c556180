"""Every way the HTTP server binds gives its accepted connections TCP_NODELAY.

uvicorn writes a response's headers and body in two writes. Without TCP_NODELAY, Nagle holds the body until
the client's delayed ACK: about 40 ms on every response, which made one client slower through vitserve than
with no service at all. asyncio (which uvicorn serves on here) sets TCP_NODELAY on an accepted connection
only when the listening socket's `proto` is IPPROTO_TCP, so a socket made with proto 0 silently loses it.
This runs the production `bind_socket` under asyncio's own accept path (`loop.create_server(sock=...)`, as
uvicorn calls it) and reads the option on the live accepted connection. vitserve offers no UNIX socket.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from vitserve.api.server import bind_socket
from vitserve.errors import ConfigError


async def _nodelay_of_accepted(sock: socket.socket) -> int:
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connection, sock=sock)
    host, port = sock.getsockname()[:2]
    _, writer = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(seen, 10)
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_accepted_connections_have_tcp_nodelay(host: str) -> None:
    try:
        sock = bind_socket(host, 0)
    except ConfigError as exc:  # e.g. a machine without IPv6 loopback
        pytest.skip(f"cannot bind {host}: {exc}")
    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(_nodelay_of_accepted(sock)) != 0
