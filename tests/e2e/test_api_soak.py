"""Soak (slow): minutes of mixed good and bad traffic; every answer is the expected one, nothing leaks."""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import pytest

from tests.e2e.live import live_server, noise_png, png_bytes
from tests.e2e.test_api_errors import png_header_only

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def request_mix(seed: int) -> list[tuple[dict, int, str | None]]:
    """(json body, expected status, expected error code)."""
    good = {"images": [{"b64": b64(noise_png(40 + 37 * seed % 500, 30 + 53 * seed % 400, seed=seed))}]}
    return [
        (good, 200, None),
        ({"images": [{"b64": "@@"}]}, 400, "invalid_request"),
        ({"images": [{"b64": b64(b"junk")}]}, 400, "invalid_image"),
        ({"images": [{"b64": b64(png_header_only(30000, 30000))}]}, 413, "payload_too_large"),
        ({"images": [{"b64": b64(png_bytes(8, 8))}] * 5}, 400, "too_many_images"),
        ({"images": [{"b64": b64(png_bytes(1, 5000))}]}, 400, "aspect_ratio_too_large"),
    ]


def test_soak_mixed_traffic():
    rounds, clients = 40, 8
    with live_server(max_images_per_request=4) as srv:
        # One request first: process-wide threads that start lazily on first use (pyzmq's garbage collector
        # for zero-copy sends) are not a leak, and would otherwise count against the soak when it runs alone.
        with srv.client() as c:
            assert c.post("/encode", json=request_mix(0)[0][0]).status_code == 200
        threads_before = threading.active_count()

        async def client(k: int) -> list[tuple[int, int, str | None, str | None]]:
            seen = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                for r in range(rounds):
                    body, status, code = request_mix(k * rounds + r)[r % 6]
                    resp = await c.post("/encode", json=body)
                    got = resp.json().get("error", {}).get("code") if resp.status_code != 200 else None
                    seen.append((status, resp.status_code, code, got))
            return seen

        async def everyone():
            return await asyncio.gather(*(client(k) for k in range(clients)))

        results = [x for per in asyncio.run(everyone()) for x in per]
        with srv.client() as c:
            assert c.get("/ready").status_code == 200
        assert srv.engine.queue_items == 0
        assert threading.active_count() <= threads_before + 2
    assert len(results) == rounds * clients
    for want_status, status, want_code, code in results:
        assert (status, code) == (want_status, want_code)
