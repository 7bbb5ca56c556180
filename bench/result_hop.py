"""Rank 0's result to the engine: through a result slot (vitserve/worker/slots.py) against the status socket's
frames, in one engine, alternating, at the sizes of one 448 px and one 1080p image at real widths.

    python bench/result_hop.py            # 8 rounds per point
    python bench/result_hop.py --quick    # 2 rounds per point

A real Engine with one spawned rank (the CPU, --tp 1) whose encoder is tests/fakes.py's FakeEncoder at the
width of the point (one matmul: the forward is not what is measured). Per request, the hop is the engine's
`encode` stage (the batch sent to its RESULT read, the ZMQ hops included) less rank 0's own `forward` stage:
the batch's trip to rank 0 and the result's trip back. "frames" is the same engine with no slot lent
(ResultSlots.lend answering ""), so both arms share the rank, the load and the sitting; each round runs both,
in rotated order. Rows: 256 (448 px) and 2,040 (1080p, Qwen3-VL's 16 px patches); widths 3,584 (Qwen2.5-VL-7B)
and 16,384 (Qwen3-VL-8B's 4,096 with three DeepStack levels), float32 as a CPU tower makes them.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

POINTS = [("448px", 16, 16), ("1080p", 34, 60)]  # (name, merged tokens high, wide): 256 and 2,040 rows
WIDTHS = [3584, 16384]


async def _one(engine, item, rid: str, slots_on: bool) -> float:  # type: ignore[no-untyped-def]
    """The hop (ms) of one request's batch: encode less forward, from the engine's own stage sums."""
    from tests.integration.engine_helpers import deadline, encode

    dispatch, metrics = engine._dispatch, engine.metrics
    dispatch.slots.min_bytes = 0  # every size through a slot in the slot arm: the bench is what set MIN_BYTES
    lend = dispatch.slots.lend
    if not slots_on:
        dispatch.slots.lend = lambda nbytes: ""
    try:
        before = [metrics.value("vitserve_stage_seconds_sum", stage=s) or 0.0 for s in ("encode", "forward")]
        await encode(engine, rid, [item], [rid], deadline=deadline(), return_embeddings=False)
        after = [metrics.value("vitserve_stage_seconds_sum", stage=s) or 0.0 for s in ("encode", "forward")]
    finally:
        dispatch.slots.lend = lend
    return 1000 * ((after[0] - before[0]) - (after[1] - before[1]))


async def _width(width: int, rounds: int, tmp: Path) -> list[dict]:
    from tests.fakes import FakeEncoderFactory, fake_item
    from tests.integration.engine_helpers import make_config, running_engine

    config = make_config(tmp / str(width), visual_batch_max_tokens=2048, request_timeout_s=300.0)
    out = []
    async with running_engine(config, FakeEncoderFactory(embed_dim=width)) as engine:
        for name, h, w in POINTS:
            hops: dict[str, list[float]] = {"slot": [], "frames": []}
            for r in range(rounds + 1):  # the first round warms both arms up
                for arm in harness.rotate(list(hops), r):
                    ms = await _one(
                        engine, fake_item(h, w, seed=1000 * r + len(arm)), f"{name}-{r}-{arm}", arm == "slot"
                    )
                    if r:
                        hops[arm].append(ms)
            point = {"image": name, "rows": h * w, "width": width, "mb": round(h * w * width * 4 / 1e6, 1),
                     **{f"{arm}_ms": round(statistics.median(v), 1) for arm, v in hops.items()},
                     **{f"{arm}_best_ms": round(min(v), 1) for arm, v in hops.items()}}  # fmt: skip
            point["slot_over_frames"] = round(point["slot_ms"] / point["frames_ms"], 2)
            print(point, flush=True)
            out.append(point)
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="2 rounds per point")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per point (default 8, --quick 2)")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 8)
    run = harness.begin("result_hop", args)
    with tempfile.TemporaryDirectory(prefix="vitserve-hop-") as tmp:
        points = [p for width in WIDTHS for p in asyncio.run(_width(width, rounds, Path(tmp)))]
    print("| image | width | MB | frames: median (best) ms | slot: median (best) ms | slot / frames |")
    print("|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p['image']} | {p['width']:,} | {p['mb']} | {p['frames_ms']} ({p['frames_best_ms']}) | "
              f"{p['slot_ms']} ({p['slot_best_ms']}) | {p['slot_over_frames']} |")  # fmt: skip
    harness.finish(run, {"points": points}, args)


if __name__ == "__main__":
    main()
