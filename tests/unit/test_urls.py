"""URL input guards (docs/processing.md): static checks and address classification. No traffic leaves loopback."""

from __future__ import annotations

import ipaddress

import httpx
import pytest

from vitserve.api.urls import (
    _pinned_url,
    check_url,
    domain_allowed,
    is_public_address,
    read_limited,
    request_headers,
    resolve_public,
)
from vitserve.errors import PayloadTooLarge, UrlNotAllowed

ip = ipaddress.ip_address


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "127.8.8.8",
        "::1",
        "169.254.169.254",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "0.0.0.0",
        "::",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "224.0.0.1",
        "ff02::1",
        "fe80::1",
        "fc00::1",
        "100.64.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "2002:7f00:1::1",
        "198.18.0.1",
    ],
)
def test_internal_addresses_are_not_public(addr):
    assert not is_public_address(ip(addr))


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses(addr):
    assert is_public_address(ip(addr))


def test_domain_allowlist_matches_domain_and_subdomains_only():
    allowed = ("example.com",)
    assert domain_allowed("example.com", allowed)
    assert domain_allowed("img.Example.COM.", allowed)
    assert not domain_allowed("evilexample.com", allowed)
    assert not domain_allowed("example.com.evil.net", allowed)
    assert not domain_allowed("example.com", ())


@pytest.mark.parametrize(
    ("url", "allow", "why"),
    [
        ("https://example.com/a.png", False, "--allow_image_urls"),
        ("file:///etc/passwd", True, "scheme"),
        ("ftp://example.com/a.png", True, "scheme"),
        ("gopher://example.com/", True, "scheme"),
        ("https://user:pw@example.com/a.png", True, "user"),
        ("https://other.org/a.png", True, "--allowed_url_domains"),
        ("http://127.0.0.1/a.png", True, "--allowed_url_domains"),
        ("http:///a.png", True, "host"),
    ],
)
def test_static_refusals(url, allow, why):
    with pytest.raises(UrlNotAllowed, match=why):
        check_url(url, allow=allow, allowed_domains=("example.com",))


def test_check_url_gives_scheme_host_port():
    assert check_url("https://img.example.com/x", allow=True, allowed_domains=("example.com",)) == (
        "https",
        "img.example.com",
        443,
    )
    assert check_url("http://example.com:8080/x", allow=True, allowed_domains=("example.com",))[2] == 8080


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0", "2130706433"]
)
async def test_resolution_to_loopback_is_refused(host):
    with pytest.raises(UrlNotAllowed, match="not a public address"):
        await resolve_public(host, 80, timeout_s=5)


def test_pinned_url_connects_to_the_checked_address():
    assert _pinned_url("https://example.com/a/b.png?x=1#f", ip("93.184.216.34"), 443) == (
        "https://93.184.216.34:443/a/b.png?x=1"
    )
    assert (
        _pinned_url("http://example.com", ip("2606:2800:220:1::1"), 80) == "http://[2606:2800:220:1::1]:80/"
    )


def test_a_video_url_asks_for_a_video_and_an_image_url_for_an_image():
    video = request_headers("https", "example.com", 443, video=True)
    image = request_headers("http", "example.com", 8080, video=False)
    assert (video["Accept"], video["Host"]) == ("video/*", "example.com")
    assert (image["Accept"], image["Host"]) == ("image/*", "example.com:8080")
    assert video["Accept-Encoding"] == image["Accept-Encoding"] == "identity"


async def _body_of(content: bytes, max_bytes: int, video: bool, declared: bool) -> bytes:
    """read_limited on a real httpx response, streamed chunk by chunk (httpx's MockTransport serves it)."""

    async def chunks():
        for i in range(0, len(content), 4):
            yield content[i : i + 4]

    def answer(request: httpx.Request) -> httpx.Response:
        if declared:
            return httpx.Response(200, content=content)  # Content-Length set
        return httpx.Response(200, content=chunks())  # chunked: no length to trust

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        client.stream("GET", "http://example.com/v.mp4") as resp,
    ):
        return await read_limited(resp, max_bytes, video)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(
    ("video", "kind", "flag"),
    [(True, "video URL", "--max_video_bytes"), (False, "image URL", "--max_request_bytes")],
)
async def test_a_body_over_its_limit_names_the_flag_of_its_kind(video, kind, flag, declared):
    body = bytes(range(40))
    assert await _body_of(body, 40, video, declared) == body
    with pytest.raises(PayloadTooLarge, match=f"the {kind}'s body is larger than 39 bytes \\({flag}\\)"):
        await _body_of(body, 39, video, declared)
