"""The front door's cost and gain: vLLM alone vs vitserve in front of the same vLLM, same run, same checkpoint.

    python bench/gateway.py --quick     # a smoke run (a few requests per point)
    python bench/gateway.py             # RESULTS.md's profile (1 and 8 clients, two workloads)

One tiny Qwen2.5-VL checkpoint (tests/checkpoints.py make_servable_checkpoint) with the demo's realistic-width
vision tower (8 blocks of 512) and a one-layer 64-wide LLM, so the tower is most of the work, as in a real
deployment's prefill. One real vLLM (scripts/vllm-env.sh's venv) serves it; one real `vitserve --llm_url`
(the CLI, a subprocess) sits in front of that same vLLM. Each point runs both paths back to back, alternating
which goes first, so both see the same background load. Clients are closed-loop and stream; the time to first
token is the time to the first event that carries content.

Workloads:
- unique: every request a new image (nothing to reuse on either path);
- repeated: one image asked about again and again, each time with a different question placed before it, so
  vLLM's prefix cache cannot cover the image; vitserve's embedding cache skips the tower. vLLM 0.32's own
  encoder cache outlives a request too (measured here: a repeated image's ttft 0.07 s on vLLM alone against
  0.77 s for a new one), so this workload compares two caches, not a cache against none.

Each run appends its record (commit, machine, load before/after, every point) to bench/out/gateway.jsonl and
prints the ratio table RESULTS.md takes: ttft p50/p99 and requests/s, vitserve+vLLM over vLLM alone.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record, report  # noqa: E402
from tests.checkpoints import make_servable_checkpoint  # noqa: E402
from tests.cli import Cli  # noqa: E402
from tests.openai_chat import data_url  # noqa: E402
from tests.vllm_server import VllmServer  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402

BUDGET = 256  # tokens per image (after merge): a 448x448 image; the checkpoint's max_pixels
IMAGE_SIDE = 448
PROFILES = {  # clients -> (seconds per point, request cap per point)
    "quick": {"clients": (1, 8), "duration_s": 10.0, "max_requests": 8},
    "standard": {"clients": (1, 8), "duration_s": 40.0, "max_requests": 200},
}


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE]
    base = np.stack([x * 255 / IMAGE_SIDE, y * 255 / IMAGE_SIDE, (x + y) * 0.28], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


class Workload:
    """Request bodies, made on demand so a point never runs out; `seed` keeps each path's stream distinct."""

    def __init__(self, name: str, model: str, seed: int):
        self.name, self.model, self.seed, self.count = name, model, seed, 0
        self.shared = data_url(_png(10_000 + seed)) if name == "repeated" else None

    def next(self) -> dict:
        self.count += 1
        if self.name == "unique":
            url, before = data_url(_png(self.seed * 100_000 + self.count)), ""
        else:
            url, before = self.shared, f"question {self.count} of {self.seed}: about the picture below,"
        content = ([{"type": "text", "text": before}] if before else []) + [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is in it?"},
        ]
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }


async def _one(http: httpx.AsyncClient, url: str, body: dict, out: dict) -> None:
    t0 = time.monotonic()
    first = None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out["errors"][str(r.status_code)] = out["errors"].get(str(r.status_code), 0) + 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - t0
    except httpx.HTTPError as exc:
        out["errors"][type(exc).__name__] = out["errors"].get(type(exc).__name__, 0) + 1
        return
    out["ttft_s"].append(first if first is not None else time.monotonic() - t0)
    out["total_s"].append(time.monotonic() - t0)


async def run_point(url: str, workload: Workload, clients: int, duration_s: float, cap: int) -> dict:
    out: dict = {"ttft_s": [], "total_s": [], "errors": {}}
    issued = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < deadline and issued < cap:
            issued += 1
            await _one(http, url, workload.next(), out)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    elapsed = time.monotonic() - start
    done = len(out["ttft_s"])
    return {
        "requests": done,
        "errors": out["errors"],
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(done / elapsed, 4) if elapsed else 0.0,
        "ttft_p50_s": _pct(out["ttft_s"], 50),
        "ttft_p99_s": _pct(out["ttft_s"], 99),
        "ttft_s": [round(x, 4) for x in out["ttft_s"]],
    }


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return round(xs[0], 4)
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4)


def _warm(url: str, model: str) -> None:
    """One request per path before timing: first-call costs (compilation, pools) are not the steady state."""
    body = Workload("unique", model, seed=99).next()
    body["stream"] = False
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600, trust_env=False)
    r.raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: a few requests per point")
    ap.add_argument("--workloads", default="unique,repeated")
    args = ap.parse_args()
    profile = PROFILES["quick" if args.quick else "standard"]
    run = record.begin("gateway", vars(args))
    tmp = Path(tempfile.mkdtemp(prefix="vitserve-gateway-"))
    vision = {k: v for k, v in Checkpoint.demo().vision.items() if k != "out_hidden_size"}
    ckpt = make_servable_checkpoint("qwen2_5_vl", tmp / "ckpt", vision=vision, max_units=BUDGET)
    vllm = VllmServer(ckpt, tmp, limit_mm={"image": 1, "video": 0})
    vitserve = None
    try:
        argv = ["--model", str(ckpt), "--port", "0", "--llm_url", vllm.url, "--device", "cpu"]
        # a batch holds up to 8 images; each image is held to BUDGET by the checkpoint's own max_pixels
        argv += ["--visual_batch_max_tokens", str(BUDGET * 8), "--cache_gb", "1"]
        vitserve = Cli(argv, tmp / "vitserve")
        vitserve.wait_ready(900)
        urls = {"vllm": vllm.url, "vitserve": vitserve.url}
        for url in urls.values():
            _warm(url, str(ckpt))
        points = []
        for i, (name, clients) in enumerate(
            (w, c) for w in args.workloads.split(",") for c in profile["clients"]
        ):
            order = ["vllm", "vitserve"] if i % 2 == 0 else ["vitserve", "vllm"]
            point: dict = {"workload": name, "clients": clients, "load_before": os.getloadavg()[0]}
            for seed, path in enumerate(order, start=1 + 2 * i):
                workload = Workload(name, str(ckpt), seed)
                point[path] = asyncio.run(
                    run_point(urls[path], workload, clients, profile["duration_s"], profile["max_requests"])
                )
            point["load_after"] = os.getloadavg()[0]
            print(json.dumps({k: v for k, v in point.items() if k not in ("vllm", "vitserve")}), flush=True)
            points.append(point)
        print("\n".join(report.gateway_table({"points": points})))
        print(f"vLLM ready in {vllm.ready_s:.0f} s; record: {record.finish(run, {'points': points})}")
    finally:
        if vitserve is not None:
            vitserve.terminate()
        vllm.stop()


if __name__ == "__main__":
    main()
