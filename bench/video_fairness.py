"""Fairness: image latency with and without long videos in the same server, same sitting.

    python bench/video_fairness.py            # 4 image clients, 2 video clients, 3 rounds of 30 s + 30 s
    python bench/video_fairness.py --quick    # 1 round of 15 s + 15 s
    python bench/video_fairness.py --tree /tmp/old   # the server from another checkout (before/after)

Starts the real CLI (`vitserve --model <ckpt>`) on a tiny Qwen2.5-VL checkpoint written by
tests/checkpoints.py (vision tower: depth 2, width 32; at most 64 merged tokens per image or frame), then runs
rounds of two phases, each `--seconds` long:

- `alone`: `--image_clients` closed-loop clients, each sending one small image per request (224x224 JPEGs,
  64 tokens after the checkpoint's clamp);
- `videos`: the same image clients while `--video_clients` more clients each send, one after the other, a
  60 s video (640x360, 30 fps, H.264 `veryfast` with B-frames, a keyframe every 250 frames; fps 2 sampling: 120
  frames, 60 temporal groups of 64 tokens) with `return_embeddings` false.

Image latency p50 / p99 per phase (all rounds pooled) and their ratio; **target: p99 with videos <= 1.5x p99
alone.** Where the time goes, from each image response's `timing_ms` (docs/api.md): queue wait
(`queue`), decode + preprocess, encode, and the rest (HTTP, the event loop, threads waiting for a core).
From /metrics: mean batch fill and items per batch per phase (the server does not say which items of a
batch are images and which are video groups). The server's CPU seconds per phase (its whole process tree,
from /proc) tell how much of the 2 cores the decoders took. The record goes to
bench/out/video_fairness.jsonl; bench/report.py prints its table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.loadgen import batch_delta, json_bodies, scrape_batch_metrics, wait_ready  # noqa: E402
from bench.serve import READY_TIMEOUT_S  # noqa: E402
from bench.workloads import small_workload  # noqa: E402
from tests.cli import CLI, Cli  # noqa: E402

VIDEO = {"seconds": 60, "fps": 30, "size": (640, 360), "gop": 250}
TIMEOUT_S = 600.0


def video_clip(out: Path) -> bytes:
    """The 60 s clip, encoded once (about a minute) and kept in bench/out/clips/."""
    w, h = VIDEO["size"]
    path = out / "clips" / f"h264_{w}x{h}_{VIDEO['fps']}fps_{VIDEO['seconds']}s_gop{VIDEO['gop']}.mp4"
    if not path.exists():
        from tests.videos import make_clip

        path.parent.mkdir(parents=True, exist_ok=True)
        frames = VIDEO["seconds"] * VIDEO["fps"]
        path.write_bytes(make_clip(frames, "mp4", fps=Fraction(VIDEO["fps"]), size=(w, h), gop=VIDEO["gop"]))
    return path.read_bytes()


@contextlib.contextmanager
def server(ckpt: Path, log: Path, tree: Path = ROOT):
    """The real CLI on the tiny checkpoint, its code from ``tree``; yields (url, pid)."""
    port = harness.free_port()
    with tempfile.TemporaryDirectory(prefix="vitserve-fair-") as runtime:
        argv = [*CLI, "--model", str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--runtime_dir", runtime,
                "--log_level", "warning", "--request_timeout_s", str(int(TIMEOUT_S)),
                "--max_queue_tokens", "1000000"]  # fmt: skip
        proc = Cli(argv, env={**os.environ, "PYTHONPATH": str(tree)}, command=(), cwd=tree, log=log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, "/ready", READY_TIMEOUT_S, proc.proc)
            yield url, proc.proc.pid
        finally:
            with contextlib.suppress(AssertionError):
                proc.terminate(60)


class Clients:
    """One phase's closed-loop clients and what they saw, until ``deadline`` (time.monotonic)."""

    def __init__(self, url: str, deadline: float) -> None:
        self.url, self.deadline = url, deadline
        self.images: list[dict[str, float]] = []  # per image request: total_ms and the response's timing_ms
        self.videos: list[dict[str, float]] = []
        self.errors: dict[str, int] = {}

    async def post(self, http: httpx.AsyncClient, body: bytes) -> tuple[float, dict | None]:
        t0 = time.monotonic()
        try:
            resp = await http.post(
                f"{self.url}/encode", content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            return 0.0, None
        if resp.status_code != 200:
            self.errors[str(resp.status_code)] = self.errors.get(str(resp.status_code), 0) + 1
            return 0.0, None
        return time.monotonic() - t0, resp.json()

    async def image_client(self, http: httpx.AsyncClient, bodies: list[bytes], k: int, step: int) -> None:
        while time.monotonic() < self.deadline:
            seconds, answer = await self.post(http, bodies[k % len(bodies)])
            k += step
            if answer is not None:
                self.images.append({"total_ms": seconds * 1e3, **answer["timing_ms"]})

    async def video_client(self, http: httpx.AsyncClient, body: bytes) -> None:
        """Sends the video again and again; the one in flight at the deadline is waited for."""
        while time.monotonic() < self.deadline:
            seconds, answer = await self.post(http, body)
            if answer is not None:
                out = answer["videos"][0]
                self.videos.append({"total_s": seconds, "decode_ms": answer["timing_ms"]["decode"],
                                    "groups": out["grid_thw"][0], "tokens": out["num_tokens"]})  # fmt: skip


async def phase(
    url: str, images: list[bytes], video: bytes | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One phase: image clients (and video clients when ``video``) for ``args.seconds``."""
    clients = Clients(url, time.monotonic() + args.seconds)
    before, t0 = scrape_batch_metrics(url), time.monotonic()
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        cpu0 = harness.tree_cpu_s(args.server_pid)
        tasks = [clients.image_client(http, images, k, args.image_clients) for k in range(args.image_clients)]
        if video is not None:
            payload = {"videos": [{"b64": base64.b64encode(video).decode()}], "return_embeddings": False}
            body = json.dumps(payload).encode()
            tasks += [clients.video_client(http, body) for _ in range(args.video_clients)]
        await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    cpu = harness.tree_cpu_s(args.server_pid) - cpu0
    return {"images": clients.images, "videos": clients.videos, "errors": clients.errors,
            "elapsed_s": round(elapsed, 2), "server_cpu_s": round(cpu, 2),
            "batches": batch_delta(before, scrape_batch_metrics(url)), "loadavg": list(os.getloadavg())}  # fmt: skip


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase kind, all rounds pooled: image latency and its parts, batches, CPU; the p99 ratio."""
    out: dict[str, Any] = {}
    for kind in ("alone", "videos"):
        ps = [p for p in phases if p["kind"] == kind]
        rows = [r for p in ps for r in p["images"]]
        parts = {
            "total": [r["total_ms"] for r in rows],
            "queue": [r["queue"] for r in rows],
            "decode_preprocess": [r["decode"] + r["preprocess"] for r in rows],
            "encode": [r["encode"] for r in rows],
            "rest": [r["total_ms"] - r["queue"] - r["decode"] - r["preprocess"] - r["encode"] for r in rows],
        }
        fills = [p["batches"]["mean_batch_fill_ratio"] for p in ps if p["batches"]["mean_batch_fill_ratio"]]
        items = [p["batches"]["mean_batch_images"] for p in ps if p["batches"]["mean_batch_images"]]
        seconds = sum(p["elapsed_s"] for p in ps)
        vids = [v for p in ps for v in p["videos"]]
        out[kind] = {
            "requests": len(rows),
            "images_per_s": round(len(rows) / seconds, 2) if seconds else None,
            "ms": {
                k: {"p50": harness.nearest(v, 0.5, 2), "p99": harness.nearest(v, 0.99, 2)}
                for k, v in parts.items()
            },
            "mean_batch_fill": round(sum(fills) / len(fills), 3) if fills else None,
            "mean_batch_items": round(sum(items) / len(items), 2) if items else None,
            "server_cores_busy": round(sum(p["server_cpu_s"] for p in ps) / seconds, 2) if seconds else None,
            "videos_done": len(vids),
            "video_s_p50": harness.nearest([v["total_s"] for v in vids], 0.5, 2),
            "video_decode_ms_p50": harness.nearest([v["decode_ms"] for v in vids], 0.5, 2),
            "errors": {k: sum(p["errors"].get(k, 0) for p in ps) for p in ps for k in p["errors"]},
        }
    alone, with_videos = out["alone"]["ms"]["total"], out["videos"]["ms"]["total"]
    if alone["p99"] and with_videos["p99"]:
        out["p99_ratio"] = round(with_videos["p99"] / alone["p99"], 2)
        out["p50_ratio"] = round(with_videos["p50"] / alone["p50"], 2)
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="1 round of 15 s phases")
    ap.add_argument("--image_clients", type=int, default=4)
    ap.add_argument("--video_clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0, help="per phase")
    ap.add_argument("--rounds", type=int, default=3, help="alone, then with videos, this many times")
    ap.add_argument(
        "--tree", type=Path, default=ROOT, help="the checkout whose server runs (an older one: A/B)"
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 15.0
    video = video_clip(args.out)
    images = json_bodies(small_workload(8))
    run = harness.begin("video_fairness", args)
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vitserve-fair-ckpt-") as tmp:
        from tests.checkpoints import make_checkpoint

        ckpt = make_checkpoint("qwen2_5_vl", Path(tmp) / "ckpt")
        with server(ckpt, args.out / "video-fairness-server.log", args.tree.resolve()) as (url, pid):
            args.server_pid = pid
            asyncio.run(
                phase(url, images[:2], video, argparse.Namespace(**{**vars(args), "seconds": 1}))
            )  # warm-up
            for k in range(args.rounds):
                for kind in ("alone", "videos"):
                    result = asyncio.run(phase(url, images, video if kind == "videos" else None, args))
                    phases.append({"kind": kind, "round": k, **result})
                    lat = sorted(r["total_ms"] for r in result["images"])
                    p50, p99 = (harness.nearest(lat, q, 2) for q in (0.5, 0.99))
                    print(f"round {k} {kind}: {len(lat)} images, p50 {p50} ms, p99 {p99} ms, "
                          f"{len(result['videos'])} videos, errors {result['errors']}, "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    summary = summarize(phases)
    print(json.dumps(summary, indent=1))
    del args.server_pid
    harness.finish(run, {"video": VIDEO, "summary": summary, "phases": phases}, args)


if __name__ == "__main__":
    main()
