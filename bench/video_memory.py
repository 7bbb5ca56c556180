"""Peak memory of the service while it encodes a short and a long video: does it stay flat with length?

    python bench/video_memory.py [--short_s 10] [--long_s 600] [--source_fps 2] [--fps 0.5] [--size 336]
                                 [--budget 288] [--quick] [--out bench/out]

For each clip, a fresh real server (`python -m vitserve.cli --model demo`, the CLI as deployed, the demo
tower on the CPU) gets one `/encode` of that one video (JSON, base64, no embeddings returned: the answer's
size grows with the video by design, the service's working memory should not). Clips are synthetic H.264 MP4
(tests/videos.py: every frame differs everywhere) of `size` x `size` pixels at `source_fps`, sampled at
`fps`, so the long clip has long_s / short_s times the sampled frames of the short one (default: 5 and
300 frames, 2 and 150 temporal groups of 576 patches).

Same batches for both: the budget (`--visual_batch_max_tokens`, default 288 = the short clip's 2 groups of
144 tokens) is one the short clip fills, so the encoder rank's working memory (bounded by the batch, by
design) is the same for both and the ratio measures what grows with the video. At the server's default
8192 a 10 s clip's one batch of 2 groups would be compared with the long clip's full batches of up to 56.

Same frame size for both: `--max_video_tokens` is raised to 10,000,000 for both servers, otherwise the
default 16,384 would shrink the long video's frames to fit and the comparison would not be at equal work
per frame. `size` is a multiple of 28 and at the demo processor's minimum (336 x 336 = its min_pixels,
rounded up), so frames are encoded at their own size.

Memory: every process of the service (the CLI's API process and all its descendants: the encoder rank and
the video decoder processes), read from /proc:
- peak_sum_rss: the highest sum of their VmRSS, polled every 20 ms (plus a poll's own ~10 ms) during the
  request (a lower bound of the true peak: a spike between polls is missed). Pages a process shares with
  another count in each: the decoders fork from the ranks' forkserver, so its pages (torch, PyAV) count
  once per decoder too;
- peak_sum_pss: the same poll of their Pss (/proc/PID/smaps_rollup: each shared page split among its
  sharers), so memory shared after a fork counts once: the memory the service takes from the machine;
- sum_hwm: the sum of each process's VmHWM (its own peak RSS since start) after the request: an upper
  bound of the peak of the sum (processes may peak at different times).
- api_hwm: the API process's own VmHWM, where the frames and pixels of a video live.
The record (commit, machine, load before and after, arguments, per clip: the numbers above and the
request's wall time) is appended to bench/out/video_memory.jsonl; the ratios long / short are the result
(the issue's target: peak memory of the long video at most 1.2x that of the short one; peak_sum_pss is the
like-for-like measure since the decoders fork).
--quick: 8 s and 60 s clips.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness  # noqa: E402
from tests.cli import Cli  # noqa: E402
from tests.videos import make_clip  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.02
MAX_VIDEO_TOKENS = 10_000_000  # no clamp: equal frame size for the short and the long clip


def status_kib(pid: int, field: str, file: str = "status") -> int:
    """A field of /proc/<pid>/status (or smaps_rollup) in KiB (0 when the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def pss_kib(pid: int) -> int:
    return status_kib(pid, "Pss", "smaps_rollup")


class Sampler(threading.Thread):
    """Polls the sums of VmRSS and of Pss over the server's process tree; ``peak_kib`` and ``peak_pss_kib``
    are the highest seen."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.peak_kib, self.peak_pss_kib, self.stop = root, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            # every poll: the decoder processes start with the first video, and a short clip's request is
            # over in ~1.5 s (looking again every 0.5 s missed them, and the short clip's peak lacked them)
            pids = harness.process_tree(self.root)
            self.peak_kib = max(self.peak_kib, sum(status_kib(pid, "VmRSS") for pid in pids))
            self.peak_pss_kib = max(self.peak_pss_kib, sum(pss_kib(pid) for pid in pids))
            time.sleep(POLL_S)


def one_clip(name: str, clip: bytes, args: argparse.Namespace, log: Path) -> dict:
    port = harness.free_port()
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-vmem-") as tmp:
        env = {**os.environ, "VITSERVE_RUNTIME_DIR": tmp, "OMP_NUM_THREADS": "1"}
        server = Cli(
            ["--model", "demo", "--port", str(port), "--device", "cpu",
             "--visual_batch_max_tokens", str(args.budget), "--max_video_tokens", str(MAX_VIDEO_TOKENS),
             "--request_timeout_s", "1800", "--max_request_bytes", "256MiB"],
            env=env, log=log,
        )  # fmt: skip
        try:
            server.wait_ready(900)
            base_kib = sum(status_kib(pid, "VmRSS") for pid in harness.process_tree(server.proc.pid))
            sampler = Sampler(server.proc.pid)
            sampler.start()
            body = {"videos": [{"b64": base64.b64encode(clip).decode(), "fps": args.fps}]}
            start = time.monotonic()
            answer = httpx.post(f"{server.url}/encode", json=body, timeout=1800)
            wall_s = time.monotonic() - start
            sampler.stop.set()
            sampler.join()
            if answer.status_code != 200:
                raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:500]}")
            [video] = answer.json()["videos"]
            pids = harness.process_tree(server.proc.pid)
            hwm = {pid: status_kib(pid, "VmHWM") for pid in pids}
        finally:
            with contextlib.suppress(AssertionError):
                server.terminate(60)
            server.wait_exit(60)
    mib = 1 / 1024
    return {
        "clip": name,
        "clip_bytes": len(clip),
        "frames_sampled": len(video["frame_indices"]),
        "grid_thw": video["grid_thw"],
        "num_tokens": video["num_tokens"],
        "resized_size": video["resized_size"],
        "clamped": video["clamped"],
        "processes": len(pids),
        "idle_sum_rss_mib": round(base_kib * mib, 1),
        "peak_sum_rss_mib": round(sampler.peak_kib * mib, 1),
        "peak_sum_pss_mib": round(sampler.peak_pss_kib * mib, 1),
        "sum_hwm_mib": round(sum(hwm.values()) * mib, 1),
        "api_hwm_mib": round(hwm[server.proc.pid] * mib, 1),
        "wall_s": round(wall_s, 2),
        "loadavg": list(os.getloadavg()),
    }


def main() -> None:
    ap = harness.parser(__doc__, quick="8 s and 60 s clips")
    ap.add_argument("--short_s", type=float, default=10.0)
    ap.add_argument("--long_s", type=float, default=600.0)
    ap.add_argument("--source_fps", type=int, default=2, help="the clips' frame rate")
    ap.add_argument("--fps", type=float, default=0.5, help="the request's sampling fps")
    ap.add_argument("--size", type=int, default=336, help="frame width and height (a multiple of 28)")
    ap.add_argument("--budget", type=int, default=288, help="--visual_batch_max_tokens (see above)")
    args = ap.parse_args()
    if args.quick:
        args.short_s, args.long_s = 8.0, 60.0
    run = harness.begin("video_memory", args)
    rows = []
    for name, seconds in (("short", args.short_s), ("long", args.long_s)):
        frames = round(seconds * args.source_fps)
        clip = make_clip(frames, "mp4", fps=Fraction(args.source_fps), size=(args.size, args.size),
                         gop=4 * args.source_fps, preset="ultrafast")  # fmt: skip
        row = {"seconds": seconds, **one_clip(name, clip, args, args.out / f"video_memory-{name}.log")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    short, long = rows
    ratios = {
        key: round(long[key] / short[key], 3)
        for key in ("peak_sum_rss_mib", "peak_sum_pss_mib", "sum_hwm_mib", "api_hwm_mib")
    }
    print(json.dumps({"long / short": ratios}))
    harness.finish(run, {"clips": rows, "ratios": ratios}, args)


if __name__ == "__main__":
    main()
