"""Reduced-scale JPEG decoding (--jpeg_draft): fidelity of embeddings and decode+preprocess speed-up.

    python bench/jpeg_draft.py --quick        # a smoke run: 2 photos, budgets 256 and 1024, 1 rep
    python bench/jpeg_draft.py                # 12 photos, budgets 256-4096 (~10 min on a shared 2-core box)

On synthetic-but-photo-like 12 MP JPEGs (bench/workloads.py: smooth gradients, hard edges, thin lines,
noise; quality 90, 4:2:0), for several token budgets:
- fidelity: cosine similarity between the embedding of the draft-decoded image and of the fully decoded one,
  per token (rows of the embedding), averaged per image; reported as the mean over images and the worst
  image (and the worst single token). Models: the demo tower, and a tiny real Qwen2.5-VL checkpoint
  (tests/checkpoints.py make_checkpoint), each with its own processor.
- speed: decode + preprocess time (median over --reps) full vs draft, one thread.
Target: mean and worst fidelity >= 0.999 for every model and budget. The flag stays off by default
either way: its embeddings are not exact (docs/jpeg_draft.md).
Each run appends its record (commit, machine, load, arguments, results) to bench/out/jpeg_draft.jsonl
(bench/harness.py).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.workloads import LARGE_SIZE, large_workload  # noqa: E402
from vitserve.model import load_encoder  # noqa: E402
from vitserve.processors import load_image_processor  # noqa: E402
from vitserve.processors.draft import JpegDraft  # noqa: E402
from vitserve.processors.prepare import prepare_image  # noqa: E402

THRESHOLD = 0.999


def prepare(blob: bytes, processor, *, jpeg_draft: bool):
    """The production decode + preprocess path, with or without --jpeg_draft."""
    return prepare_image(
        blob, processor, max_image_pixels=0, draft=JpegDraft(processor) if jpeg_draft else None
    )


def per_token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)  # (tokens,)


def fidelity(model: str, processor_name: str, photos: list[bytes], budget: int) -> dict:
    processor = load_image_processor(processor_name, budget_tokens=budget)
    encoder = load_encoder(model)
    means, worst_token, scales = [], 1.0, []
    for blob in photos:
        full_prepared = prepare(blob, processor, jpeg_draft=False)
        draft_prepared = prepare(blob, processor, jpeg_draft=True)
        full, draft = full_prepared.item, draft_prepared.item
        if (draft.grid_thw, draft.num_tokens) != (full.grid_thw, full.num_tokens):
            raise AssertionError(f"draft changed the plan: {draft.grid_thw} vs {full.grid_thw}")
        scales.append(draft_prepared.draft_scale)
        if draft_prepared.draft_scale == 1:
            means.append(1.0)  # identical decode
            continue
        emb_full, emb_draft = (e.embedding for e in encoder.encode([full, draft]))  # (tokens, dim) each
        cos = per_token_cosine(emb_full, emb_draft)
        means.append(float(cos.mean()))
        worst_token = min(worst_token, float(cos.min()))
    return {
        "budget": budget,
        "draft_scales": scales,
        "tokens": full.num_tokens,
        "mean_cosine": statistics.fmean(means),
        "worst_image_cosine": min(means),
        "worst_token_cosine": worst_token,
    }


def speed(photos: list[bytes], budget: int, reps: int) -> dict:
    """Full and draft timed alternately (same background load on a shared box); min and median."""
    processor = load_image_processor("demo", budget_tokens=budget)
    times: dict[str, list[float]] = {"full": [], "draft": []}
    for _ in range(reps):
        for blob in photos:
            for key in ("full", "draft"):
                t0 = time.perf_counter()
                prepare(blob, processor, jpeg_draft=key == "draft")
                times[key].append(time.perf_counter() - t0)
    out = {
        f"{key}_{stat.__name__}_s": stat(ts) for key, ts in times.items() for stat in (min, statistics.median)
    }
    out["speedup_min"] = out["full_min_s"] / out["draft_min_s"]
    out["speedup_median"] = out["full_median_s"] / out["draft_median_s"]
    return {"budget": budget, **out}


def main() -> None:
    ap = harness.parser(__doc__, quick="2 photos, 1 repeat, budgets 256 and 1024")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.reps = 1
    run = harness.begin("jpeg_draft", args)
    torch.set_num_threads(1)
    n = 2 if args.quick else 12
    photos = large_workload(n, seed=1000)
    # 256/1024/2048 tokens clamp a 12 MP photo to <= 1/2 per side (a draft applies); 4096+ does not
    budgets = (256, 1024) if args.quick else (256, 1024, 2048, 4096)
    with tempfile.TemporaryDirectory() as tmp:
        from tests.checkpoints import make_checkpoint

        # tiny real towers, fed by their family's public processor (same patch/merge/normalisation as the
        # checkpoint's own, whose max_pixels is tiny): the budget then decides the clamp, as in production
        models = {"demo": ("demo", "demo", budgets)}
        for family in ("qwen2_5_vl", "qwen3_vl"):
            path = str(make_checkpoint(family, Path(tmp) / family))
            models[f"tiny-{family}"] = (path, family, budgets)
        fid = {
            name: [fidelity(model, proc, photos, b) for b in bs] for name, (model, proc, bs) in models.items()
        }
    for name, rows in fid.items():
        for r in rows:
            print(
                f"[fidelity] {name:16s} budget={r['budget']:5d} scales={r['draft_scales']} "
                f"mean={r['mean_cosine']:.6f} worst_image={r['worst_image_cosine']:.6f} "
                f"worst_token={r['worst_token_cosine']:.6f}",
                flush=True,
            )
    spd = [speed(photos[:2], b, args.reps) for b in budgets]
    for r in spd:
        print(
            f"[speed] budget={r['budget']:5d} full min/median={r['full_min_s']:.3f}/{r['full_median_s']:.3f}s "
            f"draft={r['draft_min_s']:.3f}/{r['draft_median_s']:.3f}s speedup={r['speedup_min']:.2f}x "
            f"(median {r['speedup_median']:.2f}x)",
            flush=True,
        )
    ok = all(
        r["mean_cosine"] >= THRESHOLD and r["worst_image_cosine"] >= THRESHOLD
        for rows in fid.values()
        for r in rows
    )
    report = {
        "photos": n,
        "size": LARGE_SIZE,
        "threshold": THRESHOLD,
        "fidelity": fid,
        "speed": spd,
        "default_on": ok,
    }
    harness.finish(run, report, args)
    print(
        f"all cosines >= {THRESHOLD} (mean and worst image): {ok}; the flag stays opt-in either way (not exact)"
    )


if __name__ == "__main__":
    main()
