"""Decode and sample one video: vitserve's decoder against transformers' own `load_video` (PyAV backend).

    python bench/video_decode.py             # 10 s of 1280x720 at 30 fps, GOP 30 and GOP 250, 7 repeats
    python bench/video_decode.py --quick     # GOP 30 only, 3 repeats

The clip: 300 frames of tests/videos.py's numbered pictures (a moving pattern, so no frame is cheap), H.264
(libx264 `veryfast`, CRF 18: B-frames, so decode order is not display order) in MP4, a keyframe every
`--gops` frames; made once and kept in bench/out/clips/. Sampling: Qwen2.5-VL's (`Qwen2VLVideoProcessor`'s
`sample_frames`, fps 2: 20 frames, indices 0, 15, ..., 285), the same indices from vitserve's sampler
(checked equal). Each repeat runs every mode once, rotating which goes first, so all see the same load:

- `hf`: `transformers.video_utils.load_video(path, backend="pyav")` with that sampler: PyAV's default
  threads, every frame decoded up to the last index, the sampled ones converted to RGB at full size.
- `vitserve`: what a server's decoder process does (vitserve/video/decode.py, its two FFmpeg threads, torch
  at one thread): `probe` (demux, count) then `decode_frames` of the sampled indices, resized in place to the
  size Qwen2.5-VL's processor gives the frames (`smart_resize`: 1008x560 for 720p).
- `vitserve_full`: the same without the resize (full-size frames, as `hf` returns them).
- `vitserve_pool`: the resized decode through `VideoDecoder` (a spawned decoder process, the frames back over
  its pipe): the path `/encode` takes.

Frames are checked: `vitserve_full` equals `hf` byte for byte, `vitserve` equals the torch resize of `hf`'s.
Reported per mode: wall-clock median and min, and CPU seconds (this process's, or the decoder process's for
the pool). The ratio is hf's median over each mode's. **Target: vitserve >= 1.5x hf.**
The record (bench/harness.py) goes to bench/out/video_decode.jsonl; bench/report.py prints its table.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

SECONDS, FPS, SIZE, SAMPLE_FPS = 10, 30, (1280, 720), 2.0
MODES = ("hf", "vitserve", "vitserve_full", "vitserve_pool")


def clip(gop: int, out: Path) -> Path:
    """The benchmark clip for this GOP, encoded once (~20 s) and reused."""
    path = out / "clips" / f"h264_{SIZE[0]}x{SIZE[1]}_{FPS}fps_{SECONDS}s_gop{gop}.mp4"
    if not path.exists():
        from tests.videos import make_clip

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(make_clip(SECONDS * FPS, "mp4", fps=Fraction(FPS), size=SIZE, gop=gop))
    return path


class Modes:
    """The four ways to get the sampled frames of one clip, each returning (frames, indices)."""

    def __init__(self, path: Path) -> None:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        from vitserve.video.decode import VideoLimits
        from vitserve.video.decoder_pool import VideoDecoder
        from vitserve.video.sampling import SamplingRules

        self.path, self.data = path, path.read_bytes()
        self.hf = Qwen2VLVideoProcessor()  # Qwen2.5-VL's video processor class and defaults
        self.rules = SamplingRules("qwen2", self.hf.temporal_patch_size, self.hf.min_frames, self.hf.max_frames, SAMPLE_FPS)  # fmt: skip
        factor = self.hf.patch_size * self.hf.merge_size
        h, w = smart_resize(
            SIZE[1], SIZE[0], factor, self.hf.size["shortest_edge"], self.hf.size["longest_edge"]
        )
        self.size = (w, h)
        self.limits = VideoLimits()
        self.pool = VideoDecoder(1, limits=self.limits)
        self.pool.wait_ready()

    def run(self, mode: str) -> tuple[np.ndarray, list[int]]:
        if mode == "hf":
            from transformers.video_utils import load_video

            def sample(metadata: Any, **_: Any) -> Any:
                return self.hf.sample_frames(metadata, fps=SAMPLE_FPS)

            frames, metadata = load_video(str(self.path), backend="pyav", sample_indices_fn=sample)
            return frames, [int(i) for i in metadata.frames_indices]
        from vitserve.video.decode import decode_frames, probe
        from vitserve.video.sampling import sample as vitserve_sample

        if mode == "vitserve_pool":
            info = self.pool.probe(self.data, deadline_s=120)
            indices = list(vitserve_sample(self.rules, info.total_frames, info.fps).frame_indices)
            return self.pool.decode(self.data, indices, self.size, deadline_s=120), indices
        info = probe(self.data, self.limits)
        indices = list(vitserve_sample(self.rules, info.total_frames, info.fps).frame_indices)
        size = self.size if mode == "vitserve" else None
        return decode_frames(self.data, indices, size, self.limits, threads=2), indices


_POOL_PIDS: list[int] = []


def _cpu(mode: str) -> float:
    """CPU seconds used so far: by the decoder process for the pool (from /proc: a child's rusage counts only
    once it exits), else by this process."""
    if mode != "vitserve_pool":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    total = 0.0
    for pid in _POOL_PIDS:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def check(frames: dict[str, np.ndarray], indices: dict[str, list[int]], size: tuple[int, int]) -> None:
    """Same indices everywhere; full-size frames equal HF's, resized ones the torch resize of HF's."""
    from vitserve.processors.pixels import resize_uint8

    if len({tuple(v) for v in indices.values()}) != 1:
        raise SystemExit(f"the modes sampled different frames: {indices}")
    hf = frames["hf"]
    if not np.array_equal(frames["vitserve_full"], hf):
        raise SystemExit("vitserve's full-size frames differ from transformers' load_video's")
    resized = np.stack([resize_uint8(f, size) for f in hf])
    for mode in ("vitserve", "vitserve_pool"):
        if not np.array_equal(frames[mode], resized):
            raise SystemExit(f"{mode}'s frames differ from the torch resize of transformers' frames")


def bench_clip(path: Path, gop: int, repeats: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # as in a decoder process (vitserve/video/decoder_pool.py)
    modes = Modes(path)
    _POOL_PIDS[:] = modes.pool.pids()
    try:
        frames: dict[str, np.ndarray] = {}
        indices: dict[str, list[int]] = {}
        for mode in MODES:  # one unrecorded run each: imports, the pool's first call; and the frames checked
            frames[mode], indices[mode] = modes.run(mode)
        check(frames, indices, modes.size)
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for k in range(repeats):
            order = MODES[k % len(MODES) :] + MODES[: k % len(MODES)]
            for mode in order:
                c0, t0 = _cpu(mode), time.perf_counter()
                modes.run(mode)
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(_cpu(mode) - c0)
    finally:
        modes.pool.close()
    median = {m: statistics.median(wall[m]) for m in MODES}
    return {
        "gop": gop, "clip_bytes": len(modes.data), "frames": SECONDS * FPS, "indices": indices["hf"],
        "resized_size": list(modes.size), "repeats": repeats,
        "wall_s": {m: {"median": round(median[m], 3), "min": round(min(wall[m]), 3),
                       "all": [round(x, 3) for x in wall[m]]} for m in MODES},
        "cpu_s": {m: round(statistics.median(cpu[m]), 3) for m in MODES},
        "vs_hf": {m: round(median["hf"] / median[m], 2) for m in MODES if m != "hf"},
    }  # fmt: skip


def main() -> None:
    ap = harness.parser(__doc__, quick="GOP 30 only, 3 repeats")
    ap.add_argument("--gops", type=int, nargs="+", default=[30, 250], help="keyframe intervals (frames)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.quick:
        args.gops, args.repeats = [30], 3
    # the clips are made before the record starts: encoding is not measured
    clips = {gop: clip(gop, args.out) for gop in args.gops}
    run = harness.begin("video_decode", args)
    results = []
    for gop, path in clips.items():
        row = bench_clip(path, gop, args.repeats)
        results.append(row)
        w = row["wall_s"]
        print(f"GOP {gop} (load {os.getloadavg()[0]:.1f}): median s " +
              ", ".join(f"{m} {w[m]['median']:.2f}" for m in MODES) + "; x hf " +
              ", ".join(f"{m} {r:.2f}" for m, r in row["vs_hf"].items()) + " (target vitserve >= 1.5)",
              flush=True)  # fmt: skip
    harness.finish(run, {"clip": f"H.264 {SIZE[0]}x{SIZE[1]} {FPS} fps {SECONDS} s", "rows": results}, args)


if __name__ == "__main__":
    main()
