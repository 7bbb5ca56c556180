"""Preprocessing per core: vitserve's exact fast Qwen path against HF's image processor, stage by stage, with
--image_resize pil (HF's PIL processor is the one it equals; the default, torch, equals transformers' torchvision
processor, which tests/unit/test_pixels_torch.py checks).

    python bench/preprocess.py --quick      # 1 rep, budgets 256 and 8192 (~1 min)
    python bench/preprocess.py              # 3 inputs x budgets 256, 1024, 4096, 8192, 5 reps (~10 min)

Inputs (bench/workloads.py photo-like images): a 12 MP JPEG (4000x3000, quality 90), a 224 px JPEG and a
12 MP PNG. One thread (torch at 1 thread); every figure is the median of the thread's CPU seconds
(time.thread_time: what one core spends; wall time on a shared box mostly measures the neighbours), HF and
fast timed alternately in one sitting:
- decode: vitserve.images.decode_image, the same for both;
- hf: the clamped Qwen2VLImageProcessorPil as vitserve called it before the fast path
  (QwenProcessor._preprocess_hf), split by wrapping its own methods into resize (np -> PIL -> resize -> np),
  norm (rescale + normalize), patchify, and the rest (RGB conversion, copies, tensor);
- fast: QwenProcessor.preprocess (vitserve/processors/pixels.py), split the same way into norm (lookup
  and patchify) and resize (the rest: PIL resize, to numpy, the plan);
- ratio: (decode + hf) / (decode + fast); pre ratio: hf / fast, preprocessing alone.
Every fast output is checked equal to HF's (torch.equal) before it is timed.

Candidates that are not exact, reported beside it: --jpeg_draft (reduced JPEG decode, the JPEG inputs) and
OpenCV's resize (only when opencv-python-headless is installed, `pip install -e .[bench]`): its time, its
largest uint8 difference from PIL's resize and the largest embedding difference on the demo tower.
The record goes to bench/out/preprocess.jsonl (bench/harness.py); bench/report.py prints its table.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.workloads import LARGE_SIZE, SMALL_SIZE, jpeg_bytes, photo_like, png_bytes  # noqa: E402
from vitserve.images import decode_image  # noqa: E402
from vitserve.processors import load_image_processor  # noqa: E402
from vitserve.processors.draft import JpegDraft  # noqa: E402
from vitserve.processors.prepare import prepare_image  # noqa: E402

HF_STAGES = {"resize": "resize", "rescale": "norm", "normalize": "norm", "patchify": "patchify"}


def inputs() -> dict[str, bytes]:
    photo = photo_like(*LARGE_SIZE, seed=1)
    return {
        "jpeg_12mp": jpeg_bytes(photo),
        "jpeg_224": jpeg_bytes(photo_like(*SMALL_SIZE, seed=2)),
        "png_12mp": png_bytes(photo),
    }


def cpu_seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.thread_time()
    out = fn()
    return time.thread_time() - t0, out


class StageClock:
    """Wraps an object's own methods so that each call adds its CPU seconds to a stage: the stages are
    measured inside the timed call itself, so they add up to its total."""

    def __init__(self, obj: Any, stages: dict[str, str]) -> None:
        self.spent: dict[str, float] = {}
        for method, stage in stages.items():
            setattr(obj, method, self._timed(getattr(obj, method), stage))

    def _timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            seconds, out = cpu_seconds(lambda: fn(*args, **kwargs))
            self.spent[stage] = self.spent.get(stage, 0.0) + seconds
            return out

        return timed


def one_round(blob: bytes, proc: Any, hf_clock: StageClock, fast_clock: StageClock) -> dict[str, float]:
    """Decode once, then HF and fast on the same decoded image; CPU seconds per stage."""
    decode_s, decoded = cpu_seconds(lambda: decode_image(blob, max_image_pixels=0))
    image = decoded.image
    plan = proc.plan(*image.size)
    hf_clock.spent.clear()
    fast_clock.spent.clear()
    hf_s, want = cpu_seconds(lambda: proc._preprocess_hf(image, plan))
    fast_s, got = cpu_seconds(lambda: proc.preprocess(image))
    if not torch.equal(got.pixel_values, want):
        raise AssertionError("the fast path differs from HF: not a valid measurement")
    stages = {f"hf_{k}_s": v for k, v in hf_clock.spent.items()}
    if not plan.hf_native:  # vitserve resized before calling HF: count it as HF's resize
        stages["hf_resize_s"] = (
            stages.get("hf_resize_s", 0.0)
            + cpu_seconds(lambda: image.resize(plan.resized_size, resample=proc.hf.resample))[0]
        )
    stages["hf_other_s"] = hf_s - sum(stages.values())
    stages["hf_rest_s"] = hf_s - stages.get("hf_resize_s", 0.0)  # all but the resize
    stages["fast_norm_s"] = fast_clock.spent["norm"]  # lookup + patchify
    stages["fast_resize_s"] = fast_s - stages["fast_norm_s"]  # PIL resize, to numpy, the plan
    draft_s = 0.0
    if decoded.format == "JPEG":
        draft_s, _ = cpu_seconds(lambda: prepare_image(blob, proc, max_image_pixels=0, draft=JpegDraft(proc)))
    return {"decode_s": decode_s, "hf_s": hf_s, "fast_s": fast_s, "draft_total_s": draft_s, **stages}


def measure(name: str, blob: bytes, budget: int, reps: int) -> dict[str, Any]:
    proc = load_image_processor("demo", budget, resize="pil")  # the PIL fast path, against HF's PIL processor
    hf_clock, fast_clock = StageClock(proc.hf, HF_STAGES), StageClock(proc.fast, {"patchify": "norm"})
    rounds = [one_round(blob, proc, hf_clock, fast_clock) for _ in range(reps)]
    row: dict[str, Any] = {"input": name, "budget": budget, "tokens": None}
    for key in rounds[0]:
        row[key] = statistics.median(r.get(key, 0.0) for r in rounds)
    with_decode = row["decode_s"] + row["hf_s"], row["decode_s"] + row["fast_s"]
    row["ratio"] = with_decode[0] / with_decode[1]
    row["pre_ratio"] = row["hf_s"] / row["fast_s"]
    row["draft_ratio"] = with_decode[0] / row["draft_total_s"] if row["draft_total_s"] else None
    row["tokens"] = proc.count_tokens(*decode_image(blob, max_image_pixels=0).original_size)
    row["loadavg"] = list(os.getloadavg())
    return row


def opencv_candidate(blob: bytes, budget: int, reps: int) -> dict[str, Any] | None:
    """OpenCV's bicubic and area resize in place of PIL's: time, pixel and embedding differences."""
    try:
        import cv2
    except ImportError:
        return None
    from vitserve.contract import ProcessedImage
    from vitserve.model import load_encoder

    cv2.setNumThreads(1)
    proc = load_image_processor("demo", budget, resize="pil")  # the PIL fast path, against HF's PIL processor
    image = decode_image(blob, max_image_pixels=0).image
    plan = proc.plan(*image.size)
    exact = proc.preprocess(image)
    pil = np.asarray(image.resize(plan.resized_size, resample=proc.fast.resample)).astype(np.int16)
    pixels = np.asarray(image)
    encoder = load_encoder("demo")
    (want,) = encoder.encode([exact])
    out: dict[str, Any] = {"input": "jpeg_12mp", "budget": budget, "pil_resize_s": statistics.median(
        cpu_seconds(lambda: image.resize(plan.resized_size, resample=proc.fast.resample))[0] for _ in range(reps)
    )}  # fmt: skip
    for label, flag in (("cubic", cv2.INTER_CUBIC), ("area", cv2.INTER_AREA)):
        seconds = statistics.median(
            cpu_seconds(lambda f=flag: cv2.resize(pixels, plan.resized_size, interpolation=f))[0]
            for _ in range(reps)
        )
        resized = cv2.resize(pixels, plan.resized_size, interpolation=flag)
        item = ProcessedImage(torch.from_numpy(proc.fast.patchify(resized)), plan.grid_thw, plan.num_tokens,
                              plan.resized_size, plan.clamped)  # fmt: skip
        (got,) = encoder.encode([item])
        out[label] = {"resize_s": seconds, "max_pixel_diff": int(np.abs(resized.astype(np.int16) - pil).max()),
                      "max_embedding_diff": float((got.embedding - want.embedding).abs().max())}  # fmt: skip
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="1 rep, budgets 256 and 8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    args = ap.parse_args()
    if args.quick:
        args.reps, args.budgets = 1, [256, 8192]
    run = harness.begin("preprocess", args)
    torch.set_num_threads(1)
    rows = []
    blobs = inputs()
    for name, blob in blobs.items():
        for budget in args.budgets:
            rows.append(measure(name, blob, budget, args.reps))
            r = rows[-1]
            print(f"{name} budget {budget}: decode {r['decode_s']:.3f} hf {r['hf_s']:.3f} fast "
                  f"{r['fast_s']:.3f} -> {r['ratio']:.2f}x ({r['pre_ratio']:.2f}x preprocessing alone)", flush=True)  # fmt: skip
    opencv = opencv_candidate(blobs["jpeg_12mp"], 256, args.reps)
    harness.finish(run, {"rows": rows, "opencv": opencv}, args)


if __name__ == "__main__":
    main()
