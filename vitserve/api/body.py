"""Reading a request body under --max_request_bytes, while it streams in.

Content-Length, when present, is checked before a byte of the body is read; a chunked body with no
length is counted as it arrives and refused the moment it passes the cap, so memory never holds more
than the cap.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from vitserve.errors import InvalidRequest, PayloadTooLarge


class ClientGone(Exception):
    """The client closed the connection; nobody is left to answer."""


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than {limit} bytes (--max_request_bytes)")


def check_declared_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise InvalidRequest("Content-Length is not an integer") from None
    if size > limit:
        raise _too_large(limit)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge as soon as it passes `limit` bytes."""
    check_declared_length(request, limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    body = b"".join(chunks)
    request._body = body  # later request.form() parses these bytes instead of the consumed stream
    return body
