"""The front door at real widths: what handing an embedding to vLLM costs when it is as wide as a real LLM's.

    python bench/gateway_widths.py             # both models, 448 px and 1080p, 4 requests per point
    python bench/gateway_widths.py --quick     # 2 requests per point
    python bench/gateway_widths.py --ec_tree DIR   # ec_storage from another vitserve tree

Two checkpoints (tests/checkpoints.py make_servable_checkpoint) whose language model has a real width and as
few layers as it needs, so the hand-over, not the prefill, is what differs between the paths:
- qwen2_5_vl-3584: Qwen2.5-VL-7B's width (3,584: 28 heads of 128, 4 KV heads), one layer;
- qwen3_vl-4096x4: Qwen3-VL-8B's (4,096) with 3 DeepStack levels, so each row vLLM takes is 16,384 wide;
  three layers (DeepStack feeds the first three), 4 heads of 128 (the width is what matters here).
Their MLPs are narrow (256) and their vision towers tiny, with the LLM's output width: the bench measures the
hand-over, not the encode. vitserve runs the tower in bfloat16 (a GPU tower's dtype; `--dtype float32` for a
CPU without bf16 instructions), vLLM in float32.

One real vLLM per checkpoint, an encoder-cache consumer of a directory in /dev/shm (a consumer still takes raw
images and inline embeddings); in front of it, vitserve `--llm_transport inline` and, where the vitserve tree
has it, `--llm_transport ec_storage` on that directory. Modes, in one sitting, per image size, one client,
a new image per request (no cache on either side can answer), alternating which mode goes first:
- vllm: the raw image straight to vLLM (its own tower);
- inline: through vitserve, the embedding base64 in the body (handover/inline_body.py);
- ec_storage: through vitserve, the embedding in a file, a metadata-only part in the body.
Per point: ttft p50 (first content event, streamed), upstream bytes per request and vitserve's hand-over
(`vitserve_upstream_body_bytes`, `vitserve_stage_seconds{stage="handover"}`: the engine's results
back to the body ready to go). Each run appends to bench/out/gateway_widths.jsonl and prints RESULTS.md's table.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.gateway import run_point  # noqa: E402
from tests.checkpoints import VISION_CONFIGS, make_servable_checkpoint  # noqa: E402
from tests.cli import Cli  # noqa: E402
from tests.openai_chat import data_url  # noqa: E402
from tests.vllm_server import VllmServer  # noqa: E402

MAX_UNITS = 3072  # the checkpoints' max_pixels in merge units: a 1080p image fits unclamped
MODELS = {
    "qwen2_5_vl-3584": (
        "qwen2_5_vl",
        {
            "hidden_size": 3584,
            "num_hidden_layers": 1,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "intermediate_size": 256,
            "mrope_section": [16, 24, 24],
        },  # fmt: skip
        VISION_CONFIGS["qwen2_5_vl"],
    ),
    "qwen3_vl-4096x4": (
        "qwen3_vl",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "intermediate_size": 256,
            "mrope_section": [24, 20, 20],
        },  # fmt: skip
        {**VISION_CONFIGS["qwen3_vl"], "deepstack_visual_indexes": [0, 1, 2]},
    ),
}
SIZES = {"448px": (448, 448), "1080p": (1920, 1080)}


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class Images:
    """Request bodies with a new image each (made on demand); `seed` keeps each mode's images distinct."""

    def __init__(self, model: str, size: tuple[int, int], seed: int):
        self.model, self.size, self.seed, self.count = model, size, seed, 0

    def next(self) -> dict:
        self.count += 1
        url = data_url(_png(*self.size, self.seed * 1000 + self.count))
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is in it?"},
        ]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, "stream": True}  # fmt: skip


def _consumer(ec_dir: Path) -> tuple[str, ...]:
    config = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
              "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)}}  # fmt: skip
    return ("--ec-transfer-config", json.dumps(config), "--max-model-len", "4096")


def _vitserve(ckpt: Path, llm_url: str, tmp: Path, tree: Path, dtype: str, *extra: str) -> Cli:
    argv = ["--model", str(ckpt), "--port", "0", "--llm_url", llm_url, "--device", "cpu", "--dtype", dtype,
            "--visual_batch_max_tokens", str(MAX_UNITS), "--cache_gb", "0", *extra]  # fmt: skip
    server = Cli(argv, tmp, extra_env={"PYTHONPATH": str(tree)}, cwd=tree)
    server.wait_ready(900)
    return server


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    want = {"vitserve_upstream_body_bytes_sum": "bytes", "vitserve_upstream_body_bytes_count": "requests",
            'vitserve_stage_seconds_sum{stage="handover"}': "handover_s",
            'vitserve_stage_seconds_count{stage="handover"}': "handovers"}  # fmt: skip
    out = dict.fromkeys(want.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


def _point(url: str, images: Images, requests: int, vitserve: bool) -> dict:
    before = _metrics(url) if vitserve else {}
    result = asyncio.run(run_point(url, images, 1, 3600.0, requests))
    result.pop("ttft_s", None)
    if vitserve:
        after = _metrics(url)
        delta = {k: after[k] - before[k] for k in after}
        n = max(delta["handovers"], 1.0)
        result["upstream_bytes"] = round(delta["bytes"] / max(delta["requests"], 1.0))
        if delta["handovers"]:  # a tree without the stage reports none
            result["handover_ms"] = round(1000 * delta["handover_s"] / n, 1)
    return result


def run_model(name: str, tmp: Path, args: argparse.Namespace, points: list[dict]) -> None:
    family, text, vision = MODELS[name]
    ckpt = make_servable_checkpoint(family, tmp / name, vision=vision, max_units=MAX_UNITS, text=text)
    ec_dir = Path(
        tempfile.mkdtemp(prefix="vitserve-ec-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    vllm = VllmServer(ckpt, tmp, limit_mm={"image": 1, "video": 0}, extra_args=_consumer(ec_dir))
    servers: dict[str, Cli] = {}
    try:
        servers["inline"] = _vitserve(ckpt, vllm.url, tmp / f"{name}-inline", ROOT, args.dtype)
        if args.ec_tree != "none":
            ec = ["--llm_transport", "ec_storage", "--ec_storage_path", str(ec_dir)]
            servers["ec_storage"] = _vitserve(
                ckpt, vllm.url, tmp / f"{name}-ec", Path(args.ec_tree), args.dtype, *ec
            )
        urls = {"vllm": vllm.url, **{mode: s.url for mode, s in servers.items()}}
        for i, (size, requests) in enumerate((("448px", args.requests), ("1080p", args.requests))):
            modes = list(urls) if i % 2 == 0 else list(reversed(urls))
            point: dict = {"model": name, "size": size, "load_before": os.getloadavg()[0]}
            for seed, mode in enumerate(modes, start=10 * i):
                warm = Images(str(ckpt), SIZES[size], 900 + seed).next()
                httpx.post(urls[mode] + "/v1/chat/completions", json={**warm, "stream": False}, timeout=600,
                           trust_env=False).raise_for_status()  # fmt: skip
                images = Images(str(ckpt), SIZES[size], seed)
                point[mode] = _point(urls[mode], images, requests, mode != "vllm")
            point["load_after"] = os.getloadavg()[0]
            print(json.dumps(point), flush=True)
            points.append(point)
        assert vllm.alive(), "vLLM died during the run"
    finally:
        for server in servers.values():
            server.terminate()
        vllm.stop()
        shutil.rmtree(ec_dir, ignore_errors=True)  # RAM, on /dev/shm


def table(points: list[dict]) -> list[str]:
    out = ["| model (row width) | image | mode | ttft p50 (s) | / vLLM alone | upstream bytes per request | "
           "vitserve hand-over (ms) | requests | load |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in points:
        base = p["vllm"]["ttft_p50_s"]
        for mode in ("vllm", "inline", "ec_storage"):
            if mode not in p:
                continue
            r = p[mode]
            ratio = f"**{r['ttft_p50_s'] / base:.2f}x**" if mode != "vllm" and base else "-"
            sent = f"{r['upstream_bytes']:,}" if "upstream_bytes" in r else "-"
            hand = f"{r['handover_ms']:.1f}" if "handover_ms" in r else "-"
            out.append(f"| {p['model']} | {p['size']} | {mode} | {r['ttft_p50_s']:.3f} | {ratio} | {sent} | "
                       f"{hand} | {r['requests']} | {p['load_before']:.1f} |")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 requests per point")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtype", default="bfloat16", help="vitserve's --dtype (a CPU without bf16 emulates it)")
    ap.add_argument("--ec_tree", default=str(ROOT),
                    help="the vitserve tree whose ec_storage is measured; 'none' leaves the mode out")  # fmt: skip
    args = ap.parse_args()
    args.requests = 2 if args.quick else 4
    record.unwind_on_sigterm()
    run = record.begin("gateway_widths", args)
    points: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vitserve-widths-") as tmp:
        for name in args.models.split(","):
            started = time.monotonic()
            run_model(name, Path(tmp), args, points)
            print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print("\n".join(table(points)))
    print(f"record: {record.finish(run, {'points': points})}")


if __name__ == "__main__":
    main()
