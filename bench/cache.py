"""Images/s of a repeated-image workload with and without the encoder-output cache, in one run.

    python bench/cache.py [--distinct 4] [--repeats 8] [--clients 4] [--size 448] [--budget 1024]
                          [--order cyclic|grouped] [--quick] [--out bench/out]

A real Engine (spawned rank, the `demo` tower: a Qwen2.5-VL-shaped ViT, 8 layers, width 512) in this
process, no HTTP. `clients` concurrent clients send one-image requests; the workload cycles through
`distinct` images `repeats` times each (what an agent re-sending the same screenshot looks like):
`cyclic` (0 1 2 3 0 1 ...: repeats are far apart, only the cache helps) or `grouped` (0 0 0 ... 1 1 ...:
repeats arrive together, so in-flight deduplication helps too).
Images are preprocessed once up front by the real "demo" processor: the engine is what is measured.

Three modes, each on a fresh engine, same workload:
  off    no sharing at all (every request encodes; ids are opaque labels) = vitserve before the cache
  dedup  --cache_gb 0: identical images in flight at the same time share one encode
  cache  --cache_gb 1: plus the LRU cache, so each distinct image is encoded once
--quick (a smoke run): 2 distinct 224x224 images, 3 repeats. Each run appends its record (commit, machine,
load, arguments, rows) to bench/out/cache.jsonl (bench/harness.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness  # noqa: E402
from vitserve.config import Config  # noqa: E402
from vitserve.contract import EncodeRequest, PreparedImage  # noqa: E402
from vitserve.engine import Engine  # noqa: E402
from vitserve.metrics import Metrics  # noqa: E402
from vitserve.processors import load_image_processor  # noqa: E402

MODES = {"off": 0.0, "dedup": 0.0, "cache": 1.0}  # mode -> --cache_gb


def request(request_id: str, item, image_id: str, seconds: float) -> EncodeRequest:
    """A one-image engine request, as the API builds it after decoding."""
    return EncodeRequest(
        request_id,
        (PreparedImage(item, image_id, item.resized_size, 0.0, 0.0),),
        time.monotonic() + seconds,
        return_embeddings=False,
    )


def make_images(distinct: int, size: int):
    """(bytes sha256, PIL image) of `distinct` seeded noise PNGs."""
    out = []
    for k in range(distinct):
        arr = np.random.default_rng(k).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr, "RGB").save(buf, format="PNG")
        out.append((hashlib.sha256(buf.getvalue()).hexdigest(), Image.open(io.BytesIO(buf.getvalue()))))
    return out


async def run_mode(mode: str, args, processor, images) -> dict:
    config = Config(
        model="demo",
        visual_batch_max_tokens=args.budget,
        cache_gb=MODES[mode],
        device="cpu",
        runtime_dir=f"/tmp/vitserve-bench-cache-{os.getpid()}",
        request_timeout_s=600,
    )
    engine = Engine(config, Metrics())
    await engine.start()
    try:
        items = [processor.preprocess(img) for _, img in images]
        await engine.encode(request("warmup", processor.preprocess(images[0][1].rotate(90)), "warmup", 600))
        work = [k % len(items) for k in range(len(items) * args.repeats)]
        if args.order == "grouped":
            work.sort()
        queue = list(enumerate(work))

        async def client() -> None:
            while queue:
                n, k = queue.pop(0)
                image_id = (
                    f"request-{n}" if mode == "off" else images[k][0]
                )  # off: opaque ids, nothing shared
                await engine.encode(request(f"r{n}", items[k], image_id, 600))

        before = engine.metrics.value("vitserve_batch_images_sum") or 0.0
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        seconds = time.perf_counter() - start
        encoded = (engine.metrics.value("vitserve_batch_images_sum") or 0.0) - before
        row = {
            "mode": mode,
            "order": args.order,
            "images": len(work),
            "encoded": int(encoded),
            "seconds": round(seconds, 3),
            "images_per_s": round(len(work) / seconds, 2),
            "tokens_per_image": items[0].num_tokens,
        }
        if mode == "cache":
            row["hit_ms"] = round(await hit_seconds(engine, items[0], images[0][0]) * 1e3, 3)
        return row
    finally:
        await engine.shutdown()


async def hit_seconds(engine, item, image_id: str, n: int = 200) -> float:
    """Mean engine.encode() latency of a one-image request served from the cache (inline embeddings off)."""
    start = time.perf_counter()
    for k in range(n):
        (res,) = await engine.encode(request(f"hit{k}", item, image_id, 60))
        assert res.cached
    return (time.perf_counter() - start) / n


async def main() -> None:
    p = harness.parser(__doc__, quick="2 distinct 224x224 images, 3 repeats")
    p.add_argument("--distinct", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--order", choices=("cyclic", "grouped"), default="cyclic")
    args = p.parse_args()
    if args.quick:
        args.distinct, args.repeats, args.size = 2, 3, 224
    run = harness.begin("cache", args)
    processor = load_image_processor("demo", budget_tokens=args.budget)
    images = make_images(args.distinct, args.size)
    rows = [await run_mode(mode, args, processor, images) for mode in MODES]
    base = rows[0]["images_per_s"]
    for r in rows:
        r["speedup_vs_off"] = round(r["images_per_s"] / base, 2)
        print(json.dumps(r))
    print("\n| mode | images | encoded | images/s | x off |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['images']} | {r['encoded']} | {r['images_per_s']} | {r['speedup_vs_off']} |"
        )
    harness.finish(run, rows, args)


if __name__ == "__main__":
    asyncio.run(main())
