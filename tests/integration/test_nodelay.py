"""Every way the HTTP server binds gives its accepted connections TCP_NODELAY.

uvicorn writes a response's headers and body in two writes. Without TCP_NODELAY, Nagle holds the body until
the client's delayed ACK: about 40 ms on every response, which made one client slower through vitserve than
with no service at all. asyncio (which uvicorn serves on here) sets TCP_NODELAY on an accepted connection
only when the listening socket's `proto` is IPPROTO_TCP, so a socket made with proto 0 silently loses it.

vitserve binds only TCP sockets (`bind_socket`, from --host/--port; it offers no UNIX socket): an IPv4 or
IPv6 address, a name, or a wildcard. For each, the option is read on a live accepted connection, both under
asyncio's own accept path (`loop.create_server(sock=...)`, as uvicorn calls it) and under the production
uvicorn server (`http_server`) answering a real request. A host the machine cannot bind (no IPv6) skips.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from starlette.types import Receive, Scope, Send

from vitserve.api.listen import bind_socket
from vitserve.api.server import http_server
from vitserve.errors import ConfigError

HOSTS = ["127.0.0.1", "::1", "localhost", "0.0.0.0", "::"]
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # where a client reaches a wildcard bind


def _bound(host: str) -> socket.socket:
    try:
        sock = bind_socket(host, 0)
    except ConfigError as exc:  # e.g. a machine without IPv6
        pytest.skip(f"cannot bind {host}: {exc}")
    assert sock.proto == socket.IPPROTO_TCP
    return sock


def _address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return _LOOPBACK.get(host, host), port


def _nodelay(transport: asyncio.BaseTransport) -> int:
    return int(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


async def _nodelay_under_asyncio(sock: socket.socket) -> int:
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.set_result(_nodelay(writer.transport))
        writer.close()

    server = await asyncio.start_server(on_connection, sock=sock)
    _, writer = await asyncio.open_connection(*_address(sock))
    try:
        return await asyncio.wait_for(seen, 10)
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def _hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _nodelay_under_uvicorn(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The production server answers one request; TCP_NODELAY of its live connections meanwhile."""
    server = http_server(_hello, "warning")
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*_address(sock))
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")  # keep-alive: the connection stays open
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        flags = [_nodelay(conn.transport) for conn in server.server_state.connections]  # type: ignore[attr-defined]
        writer.close()
        return head.split(b"\r\n", 1)[0], flags
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


@pytest.mark.parametrize("host", HOSTS)
def test_accepted_connections_have_tcp_nodelay(host: str) -> None:
    assert asyncio.run(_nodelay_under_asyncio(_bound(host))) != 0


@pytest.mark.parametrize("host", HOSTS)
def test_production_server_connections_have_tcp_nodelay(host: str) -> None:
    status, flags = asyncio.run(_nodelay_under_uvicorn(_bound(host)))
    assert status == b"HTTP/1.1 200 OK"
    assert flags  # the connection is still open
    assert all(flag != 0 for flag in flags)


def test_a_socket_made_with_proto_zero_would_lose_it() -> None:
    """The check above can fail: the same accept path on a socket made the old way has no TCP_NODELAY."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0, as vitserve 0.1.0 made it
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    assert asyncio.run(_nodelay_under_asyncio(sock)) == 0


def test_production_server_parses_http_with_httptools() -> None:
    """httptools is a dependency (pyproject.toml) and uvicorn's "auto" must pick it: h11 costs more per
    request (bench/RESULTS.md, "One client, stage by stage")."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    server = http_server(_hello, "warning")
    server.config.load()
    assert server.config.http_protocol_class is HttpToolsProtocol
