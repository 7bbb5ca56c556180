"""The naive server vitserve is measured against: what a team would write in a day.

    python bench/baseline_server.py --port 8200 [--budget 1024] [--threads 2]

FastAPI + the Hugging Face image processor (PIL backend) + the Hugging Face vision tower, unmodified (the
same seeded demo weights as `vitserve --model demo`, built by vitserve.model.demo but WITHOUT vitserve's
fast kernels). One image per forward, a lock around the model, the same JSON /encode request shape
(``{"images": [{"b64": ...}], "return_embeddings": false}``) so one load generator drives both servers.

For a fair comparison it encodes the same number of tokens per image as vitserve: the processor's
``max_pixels`` is set to ``budget * 28 * 28`` (what vitserve's clamp does; a team would set max_pixels too,
or a 12 MP photo costs 16384 tokens). FastAPI runs the sync handler in its thread pool, so decoding and
preprocessing of concurrent requests overlap; only the forward is serialised.
"""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from PIL import Image, ImageOps
from pydantic import BaseModel
from transformers import Qwen2VLImageProcessorPil

from vitserve.model.demo import build_demo_visual

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
FACTOR = 28  # patch 14 x merge 2


class ImageIn(BaseModel):
    b64: str


class EncodeRequest(BaseModel):
    images: list[ImageIn]
    request_id: str | None = None
    return_embeddings: bool = False


def naive_processor(budget_tokens: int) -> Qwen2VLImageProcessorPil:
    """The HF processor as this server uses it (bench/latency.py times it in-process too)."""
    return Qwen2VLImageProcessorPil(
        min_pixels=56 * 56,
        max_pixels=budget_tokens * FACTOR * FACTOR,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )


def create_app(budget_tokens: int) -> FastAPI:
    app = FastAPI(title="baseline encoder server")
    processor = naive_processor(budget_tokens)
    model = build_demo_visual()  # plain HF Qwen2.5-VL vision tower, eval mode, fp32
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/encode")
    def encode(req: EncodeRequest) -> dict:
        t0 = time.perf_counter()
        prep_s = forward_s = 0.0
        out = []
        for index, image in enumerate(req.images):
            t_image = time.perf_counter()
            try:
                pil = ImageOps.exif_transpose(Image.open(io.BytesIO(base64.b64decode(image.b64)))).convert(
                    "RGB"
                )
            except Exception as exc:
                raise HTTPException(400, f"image {index}: {exc}") from exc
            inputs = processor(images=pil, return_tensors="pt")
            with lock, torch.inference_mode():
                t_forward = time.perf_counter()
                emb = model(
                    inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]
                ).pooler_output  # (tokens, dim)
                forward_s += time.perf_counter() - t_forward
            prep_s += t_forward - t_image
            out.append(
                {
                    "index": index,
                    "num_tokens": int(emb.shape[0]),
                    "grid_thw": inputs["image_grid_thw"][0].tolist(),
                    "original_size": list(pil.size),
                }
            )
        return {
            "request_id": req.request_id,
            "images": out,
            # prep: decode + preprocess (+ waiting for the lock); bench/latency.py splits the request so
            "timing_ms": {
                "total": (time.perf_counter() - t0) * 1e3,
                "prep": prep_s * 1e3,
                "forward": forward_s * 1e3,
            },
        }

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--budget", type=int, default=1024, help="max tokens per image (sets max_pixels)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    uvicorn.run(create_app(args.budget), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
