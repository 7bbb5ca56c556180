"""Closed-loop HTTP load generator and /metrics scraping for bench/serve.py (loopback only).

Each of `concurrency` clients sends one request, waits for the answer, sends the next, until the point's
duration or request cap is reached; requests in flight then finish (bounded by the client timeout).
Request bodies are built once up front so the generator spends little CPU on the shared machine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from dataclasses import dataclass, field

import httpx

from bench import harness


def json_bodies(images: list[bytes], per_request: int = 1) -> list[bytes]:
    """SPEC §2 JSON bodies, `per_request` consecutive images each."""
    bodies = []
    for start in range(0, len(images), per_request):
        chunk = images[start : start + per_request]
        payload = {
            "images": [{"b64": base64.b64encode(b).decode()} for b in chunk],
            "return_embeddings": False,
        }
        bodies.append(json.dumps(payload).encode())
    return bodies


@dataclass
class PointResult:
    concurrency: int
    requests_ok: int = 0
    images_ok: int = 0
    tokens_ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.images_ok / self.elapsed_s if self.elapsed_s else 0.0

    def percentile(self, q: float) -> float | None:
        return harness.nearest(self.latencies_s, q / 100)

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "requests_ok": self.requests_ok,
            "images_ok": self.images_ok,
            "tokens_ok": self.tokens_ok,
            "errors": self.errors,
            "elapsed_s": round(self.elapsed_s, 3),
            "images_per_s": round(self.images_per_s, 4),
            "p50_s": self.percentile(50),
            "p99_s": self.percentile(99),
            "latencies_s": [round(x, 4) for x in self.latencies_s],
        }


async def run_point(
    url: str, bodies: list[bytes], *, concurrency: int, duration_s: float, max_requests: int, timeout_s: float
) -> PointResult:
    """Drive `url`/encode with `concurrency` closed-loop clients."""
    result = PointResult(concurrency)
    next_index = 0
    issued = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_index, issued
        while time.monotonic() < deadline and issued < max_requests:
            body = bodies[next_index % len(bodies)]
            next_index += 1
            issued += 1
            await _one_request(http, url, body, result)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    result.elapsed_s = time.monotonic() - start
    return result


async def _one_request(http: httpx.AsyncClient, url: str, body: bytes, result: PointResult) -> None:
    t0 = time.monotonic()
    try:
        resp = await http.post(f"{url}/encode", content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        key = type(exc).__name__
        result.errors[key] = result.errors.get(key, 0) + 1
        return
    if resp.status_code != 200:
        result.errors[str(resp.status_code)] = result.errors.get(str(resp.status_code), 0) + 1
        return
    images = resp.json()["images"]
    result.latencies_s.append(time.monotonic() - t0)
    result.requests_ok += 1
    result.images_ok += len(images)
    result.tokens_ok += sum(int(im["num_tokens"]) for im in images)


_SAMPLE = re.compile(r"^(vitserve_batch_(?:fill_ratio|tokens|images)_(?:sum|count))\s+(\S+)$", re.MULTILINE)


def scrape_batch_metrics(url: str) -> dict[str, float]:
    """Sum/count of the batch histograms from vitserve's /metrics (empty for a server without them)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


def batch_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean batch fill / tokens / images over the batches run between two scrapes."""
    out: dict[str, float | None] = {}
    for name in ("fill_ratio", "tokens", "images"):
        count = after.get(f"vitserve_batch_{name}_count", 0) - before.get(f"vitserve_batch_{name}_count", 0)
        total = after.get(f"vitserve_batch_{name}_sum", 0) - before.get(f"vitserve_batch_{name}_sum", 0)
        out[f"mean_batch_{name}"] = total / count if count else None
    out["batches"] = after.get("vitserve_batch_fill_ratio_count", 0) - before.get(
        "vitserve_batch_fill_ratio_count", 0
    )
    return out


def wait_ready(url: str, path: str, timeout_s: float, proc, poll_s: float = 0.5) -> None:
    """Poll until `path` answers 200; raise if the server process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"server at {url} not ready after {timeout_s}s")
