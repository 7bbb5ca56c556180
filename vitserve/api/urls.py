"""Fetching image URLs without opening an SSRF hole (docs/processing.md).

Refused unless --allow_image_urls; then http(s) only, the host must be in --allowed_url_domains, and
every address it resolves to must be public (not private, loopback, link-local, reserved, multicast or
unspecified, also when hidden in an IPv4-mapped IPv6 address).  The connection goes to the address that
was checked (the URL is rewritten to the IP, with Host / SNI set to the name), so a second DNS answer
cannot swap in an internal address.  No redirects, no proxies from the environment, a size cap of
--max_request_bytes and the request's deadline.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import httpx

from vitserve.errors import InvalidRequest, PayloadTooLarge, Timeout, UrlNotAllowed

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_public_address(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d reaches a.b.c.d: judge that address
            return is_public_address(ip.ipv4_mapped)
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None and not is_public_address(embedded):
            return False
    blocked = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved
    blocked = blocked or ip.is_multicast or ip.is_unspecified
    return ip.is_global and not blocked


def domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """`host` is a listed domain or a subdomain of one (case-insensitive, trailing dots ignored)."""
    host = host.lower().rstrip(".")
    for domain in allowed:
        d = domain.lower().strip().rstrip(".").strip("[]")
        if d and (host == d or host.endswith("." + d)):
            return True
    return False


def check_url(url: str, *, allow: bool, allowed_domains: tuple[str, ...]) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL that passes the static checks, else UrlNotAllowed."""
    if not allow:
        raise UrlNotAllowed("image URLs are disabled; start vitserve with --allow_image_urls to enable them")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise UrlNotAllowed("the image URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise UrlNotAllowed(f"URL scheme {scheme or '(none)'!r} is not allowed; only http and https")
    host = (parts.hostname or "").lower()
    if not host or parts.username is not None or parts.password is not None:
        raise UrlNotAllowed("the image URL needs a host and no user:password part")
    if not domain_allowed(host, allowed_domains):
        raise UrlNotAllowed(f"host {host!r} is not in --allowed_url_domains")
    return scheme, host, port or _DEFAULT_PORTS[scheme]


async def resolve_public(host: str, port: int, timeout_s: float) -> IPAddress:
    """The first address of `host`, after checking that EVERY address it resolves to is public."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), max(timeout_s, 0)
        )
    except TimeoutError:
        raise Timeout(f"resolving {host!r} passed the deadline (--request_timeout_s)") from None
    except OSError:
        raise InvalidRequest(f"host {host!r} of the image URL cannot be resolved") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for ip in addresses:
        if not is_public_address(ip):
            raise UrlNotAllowed(f"host {host!r} resolves to {ip}, which is not a public address")
    if not addresses:
        raise InvalidRequest(f"host {host!r} of the image URL has no address")
    return addresses[0]


def _pinned_url(url: str, ip: IPAddress, port: int) -> str:
    parts = urlsplit(url)
    literal = f"[{ip}]" if ip.version == 6 else str(ip)
    return urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))


def request_headers(scheme: str, host: str, port: int, video: bool) -> dict[str, str]:
    """The GET's headers: the checked host (the connection goes to its pinned address), the media type
    asked for, and no compression (the size limit counts the bytes as sent)."""
    return {
        "Host": host if port == _DEFAULT_PORTS[scheme] else f"{host}:{port}",
        "Accept": "video/*" if video else "image/*",
        "Accept-Encoding": "identity",
    }


async def fetch_image_url(
    url: str,
    *,
    allow: bool,
    allowed_domains: tuple[str, ...],
    max_bytes: int,
    deadline: float,
    video: bool = False,
) -> bytes:
    """The bytes behind an image URL (a video URL with `video`: its size limit is --max_video_bytes), under
    every rule in the module docstring."""
    what = "video URL" if video else "image URL"
    scheme, host, port = check_url(url, allow=allow, allowed_domains=allowed_domains)
    ip = await resolve_public(host, port, deadline - time.monotonic())
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Timeout(f"fetching the {what} passed the deadline (--request_timeout_s)")
    headers = request_headers(scheme, host, port, video)
    try:
        async with (
            httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=remaining) as client,
            client.stream(
                "GET", _pinned_url(url, ip, port), headers=headers, extensions={"sni_hostname": host}
            ) as resp,
        ):
            return await read_limited(resp, max_bytes, video)
    except httpx.TimeoutException:
        raise Timeout(f"fetching the {what} passed the deadline (--request_timeout_s)") from None
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"fetching the {what} from {host!r} failed ({type(exc).__name__})") from None


async def read_limited(resp: httpx.Response, max_bytes: int, video: bool = False) -> bytes:
    """The body of a 200 answer, refused past `max_bytes` (--max_video_bytes for a video, else
    --max_request_bytes) whatever Content-Length claims; a redirect or another status is refused."""
    what = "video URL" if video else "image URL"
    if resp.is_redirect or 300 <= resp.status_code < 400:
        raise UrlNotAllowed(
            f"the {what} answered a redirect (HTTP {resp.status_code}); redirects are not followed"
        )
    if resp.status_code != 200:
        raise InvalidRequest(f"the {what} answered HTTP {resp.status_code}")
    flag = "--max_video_bytes" if video else "--max_request_bytes"
    too_large = PayloadTooLarge(f"the {what}'s body is larger than {max_bytes} bytes ({flag})")
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
