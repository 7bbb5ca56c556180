"""TP=2 end to end, DEFAULT flags: what an HTTP client gets equals transformers' own vision tower.

The server is what `vitserve --tp 2` builds (vitserve.cli's wiring: processor, then Engine with the
processor's clamp), over a tiny real Qwen3-VL checkpoint, with default flags except what a test must set:
the checkpoint, an ephemeral port, a runtime dir, a short heartbeat, and --visual_reserved_mem_gb. That
last one only skips the start-up stress, which at the default 8192-token budget is one 32,768-patch
full-attention forward, run twice: measured 317 s for one run on this 2-core machine. It decides how much
memory is reserved, never how a request is computed. The reference never goes through
vitserve: PIL decodes the bytes, the checkpoint's own HF image processor makes the pixels, and
`model.visual(pixel_values, grid_thw)` of the full model loaded with from_pretrained makes the embedding.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from tests.checkpoints import hf_reference, make_checkpoint
from tests.e2e.live import live_server
from tests.imagegen import encode, noise
from vitserve.config import Config
from vitserve.processors import load_image_processor
from vitserve.rpc.tensors import tensor_from_buffer

FAMILY = "qwen3_vl"
# fp32 on both sides. Unsharded, the tower equals HF's to ~2e-7 of the output scale (measured, see
# tests/unit/test_equivalence.py); the two ranks' all_reduce of row-parallel halves adds round-off of the
# same order. At values of ~0.3, 1e-4 is round-off with wide margin, while a wrong decode is not: with
# --jpeg_draft on, the 700x500 JPEG missed by 2.2e-2 on 2556 of 2592 values (measured).
ATOL = 1e-4
# (width, height, format): larger than the tiny checkpoint's max_pixels (HF resizes them down), smaller,
# and odd shapes; JPEGs at PIL's default quality, so their decoded pixels are not the noise that was saved.
IMAGES = [(700, 500, "JPEG"), (640, 480, "PNG"), (120, 90, "JPEG"), (50, 300, "PNG"), (333, 77, "JPEG")]

pytestmark = pytest.mark.timeout(300)


def cli_engine(processor):
    """The Engine exactly as vitserve.cli builds it: given the checkpoint the processor was built from."""
    from vitserve.engine import Engine

    return lambda config, metrics: Engine(config, metrics, checkpoint=processor.checkpoint)


def decode_tensor(field: dict) -> torch.Tensor:
    return tensor_from_buffer(base64.b64decode(field["b64"]), field["dtype"], field["shape"])


def hf_rows(path, reference, data: bytes):
    """HF's answer for encoded image bytes: PIL decode, the checkpoint's HF processor, model.visual. The
    processor is transformers' torchvision ("fast") one, whose pixels vitserve's default --image_resize
    (torch) reproduces bit for bit: the PIL processor's differ by up to 0.23 in normalised pixels, which moves
    the embeddings past ATOL (docs/processing.md)."""
    rgb = Image.open(io.BytesIO(data)).convert("RGB")
    hf = AutoImageProcessor.from_pretrained(str(path), backend="torchvision")(
        images=[rgb], return_tensors="pt"
    )
    grid = hf["image_grid_thw"]  # (1, 3): t, h, w in patches
    embedding, deepstack = reference(hf["pixel_values"], grid)
    return rgb.size, [int(v) for v in grid[0]], embedding, deepstack


def test_tp2_defaults_png_and_jpeg_equal_transformers(tmp_path):
    path = make_checkpoint(FAMILY, tmp_path / "ckpt")
    config = Config(
        model=str(path),
        tp=2,
        port=0,
        runtime_dir=str(tmp_path / "rt"),
        heartbeat_s=2.0,
        visual_reserved_mem_gb=0.5,
    )
    processor = load_image_processor(
        config.model, budget_tokens=config.visual_batch_max_tokens, family=config.model_family
    )
    images = [encode(noise(w, h, seed=i), fmt) for i, (w, h, fmt) in enumerate(IMAGES)]
    files = [("images", (f"image{i}", data, "application/octet-stream")) for i, data in enumerate(images)]
    with (
        live_server(config, processor=processor, make_engine=cli_engine(processor)) as srv,
        httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http,
    ):
        info = http.get("/v1/info").json()
        resp = http.post("/encode", files=files, data={"return_embeddings": "true"})
    assert (info["tp"], info["dp"]) == (2, 1)
    assert resp.status_code == 200, resp.text
    answers = resp.json()["images"]
    assert len(answers) == len(images)

    reference = hf_reference(path, FAMILY)
    patch = processor_patch(path)
    for (width, height, fmt), data, got in zip(IMAGES, images, answers, strict=True):
        size, grid, want, want_deep = hf_rows(path, reference, data)
        where = f"{fmt} {width}x{height}"
        assert got["original_size"] == list(size), where
        assert got["grid_thw"] == grid, where  # the same resize as HF's own processor made
        assert got["resized_size"] == [grid[2] * patch, grid[1] * patch], where
        embedding = decode_tensor(got["embedding"])
        assert embedding.dtype == torch.float32, where
        torch.testing.assert_close(embedding, want, rtol=0, atol=ATOL, msg=lambda m, w=where: f"{w}: {m}")
        assert len(got["deepstack"]) == len(want_deep) == 2, where
        for layer, want_layer in zip(got["deepstack"], want_deep, strict=True):
            torch.testing.assert_close(decode_tensor(layer), want_layer, rtol=0, atol=ATOL)


def processor_patch(path) -> int:
    return int(AutoImageProcessor.from_pretrained(str(path), backend="pil").patch_size)
