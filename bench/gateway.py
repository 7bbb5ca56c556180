"""The front door against vLLM alone, in front of the same vLLM in one sitting: what it costs and what it gains.

    python bench/gateway.py --quick             # a smoke run (a few requests per point)
    python bench/gateway.py                     # RESULTS.md's profile (1 and 8 clients, two workloads)
    python bench/gateway.py --widths            # the hand-over at real LLM widths, 448 px and 1080p
    python bench/gateway.py --widths --quick    # 2 requests per point
    python bench/gateway.py --widths --ec_tree DIR   # ec_storage from another vitserve tree
    python bench/gateway.py --widths --transports wire   # only the wire sitting

Compared arms, each point in alternating order (bench/harness.py), clients closed-loop and streaming; the
time to first token is the time to the first event that carries content:
- vllm: the raw image straight to vLLM (its own tower);
- vitserve: the real `vitserve --llm_url` CLI (a subprocess) in front of that vLLM; with --widths, two of them:
  inline (the embedding base64 in the body) and ec_storage (the embedding in a file, a metadata-only part);
- with --widths, wire: vitserve with `--llm_transport wire` pushing each embedding over ZMQ (TCP loopback) to
  vitserve's own connector (vitserve.vllm_connector) in a second vLLM (one vLLM has one EC connector), in a
  sitting of its own against vllm alone on that same vLLM. Each point names its vLLM's connector
  (`connector`: ec_example or vitserve); `--transports` leaves arms out.

Default (record `gateway`): one tiny Qwen2.5-VL checkpoint (tests/checkpoints.py make_servable_checkpoint)
with the demo's realistic-width tower (8 blocks of 512) and a one-layer 64-wide LLM, so the tower is most of
the work, as in a real deployment's prefill; 448 px images. Workloads:
- unique: every request a new image (nothing to reuse on either path);
- repeated: one image asked about again and again, each time after a different question, so vLLM's prefix
  cache cannot cover the image; vitserve's embedding cache skips the tower. vLLM 0.32's own encoder cache
  outlives a request too (a repeated image's ttft 0.07 s on vLLM alone against 0.77 s for a new one), so this
  compares two caches, not a cache against none.
Prints ttft p50/p99 and requests/s, vitserve+vLLM over vLLM alone.

--widths (record `gateway_widths`): two checkpoints whose LLM has a real width and as few layers as it needs,
so the hand-over, not the prefill, is what differs: qwen2_5_vl-3584 (Qwen2.5-VL-7B's width, one layer) and
qwen3_vl-4096x4 (Qwen3-VL-8B's 4,096 with 3 DeepStack levels: rows 16,384 wide; three layers). Narrow MLPs,
tiny towers with the LLM's output width; vitserve's tower in bfloat16 (`--dtype float32` for a CPU without
bf16), vLLM in float32, an encoder-cache consumer of a directory in /dev/shm (ECExampleConnector), or, for
wire, of vitserve's connector (endpoint on a free loopback port, max_gb 4, no key). One client, a new image per
request, per image size. Per point: ttft p50, upstream bytes per request and vitserve's hand-over
(`vitserve_upstream_body_bytes`, `vitserve_stage_seconds{stage="handover"}`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness, report  # noqa: E402
from bench.workloads import SIZES, gradient_png  # noqa: E402
from tests.checkpoints import VISION_CONFIGS, make_servable_checkpoint  # noqa: E402
from tests.cli import Cli  # noqa: E402
from tests.openai_chat import data_url  # noqa: E402
from tests.vllm_server import VllmServer, unused_port  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402

BUDGET = 256  # tokens per image (after merge): a 448x448 image; the default checkpoint's max_pixels
PROFILES = {  # clients, seconds per point, request cap per point
    "quick": {"clients": (1, 8), "duration_s": 10.0, "max_requests": 8},
    "standard": {"clients": (1, 8), "duration_s": 40.0, "max_requests": 200},
}
MAX_UNITS = 3072  # --widths: the checkpoints' max_pixels in merge units: a 1080p image fits unclamped
_LM = {"intermediate_size": 256, "head_dim": 128}
MODELS = {  # --widths: name -> (family, language model, vision tower)
    "qwen2_5_vl-3584": ("qwen2_5_vl", {**_LM, "hidden_size": 3584, "num_hidden_layers": 1,
        "num_attention_heads": 28, "num_key_value_heads": 4, "mrope_section": [16, 24, 24]},
        VISION_CONFIGS["qwen2_5_vl"]),
    "qwen3_vl-4096x4": ("qwen3_vl", {**_LM, "hidden_size": 4096, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 1, "mrope_section": [24, 20, 20]},
        {**VISION_CONFIGS["qwen3_vl"], "deepstack_visual_indexes": [0, 1, 2]}),
}  # fmt: skip


class Bodies:
    """Streamed chat bodies with one image each, made on demand so a point never runs out. `repeated`: one
    image, each time after a different question; otherwise a new image per request. `seed` keeps each arm's
    images distinct."""

    def __init__(
        self, model: str, size: tuple[int, int], seed: int, repeated: bool = False, max_tokens: int = 8
    ):
        self.model, self.size, self.seed, self.count, self.max_tokens = model, size, seed, 0, max_tokens
        self.shared = data_url(gradient_png(*size, 10_000 + seed)) if repeated else None

    def next(self) -> dict:
        self.count += 1
        if self.shared is None:
            url, before = data_url(gradient_png(*self.size, self.seed * 100_000 + self.count)), []
        else:
            url = self.shared
            before = [
                {"type": "text", "text": f"question {self.count} of {self.seed}: about the picture below,"}
            ]
        content = [
            *before,
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is in it?"},
        ]
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True}  # fmt: skip


async def _one(http: httpx.AsyncClient, url: str, body: dict, out: dict) -> None:
    t0 = time.monotonic()
    first = None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out["errors"][str(r.status_code)] = out["errors"].get(str(r.status_code), 0) + 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - t0
    except httpx.HTTPError as exc:
        out["errors"][type(exc).__name__] = out["errors"].get(type(exc).__name__, 0) + 1
        return
    out["ttft_s"].append(first if first is not None else time.monotonic() - t0)
    out["total_s"].append(time.monotonic() - t0)


async def run_point(url: str, bodies: Bodies, clients: int, duration_s: float, cap: int) -> dict:
    """`clients` closed-loop streaming clients until `duration_s` passed or `cap` requests were issued."""
    out: dict = {"ttft_s": [], "total_s": [], "errors": {}}
    issued = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < deadline and issued < cap:
            issued += 1
            await _one(http, url, bodies.next(), out)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    elapsed = time.monotonic() - start
    done = len(out["ttft_s"])
    return {"requests": done, "errors": out["errors"], "elapsed_s": round(elapsed, 3),
            "req_per_s": round(done / elapsed, 4) if elapsed else 0.0, "ttft_p50_s": harness.pct(out["ttft_s"], 50),
            "ttft_p99_s": harness.pct(out["ttft_s"], 99), "ttft_s": [round(x, 4) for x in out["ttft_s"]]}  # fmt: skip


def _warm(url: str, bodies: Bodies) -> None:
    """One request before timing: first-call costs (compilation, pools) are not the steady state."""
    body = {**bodies.next(), "stream": False}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=600, trust_env=False).raise_for_status()


@contextmanager
def serving(ckpt: Path, tmp: Path, fronts: dict[str, tuple[list[str], Path]], vllm_args: tuple[str, ...] = (),
            vllm_env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:  # fmt: skip
    """One vLLM and, in front of it, one vitserve per `fronts` entry (name: its arguments, its tree); the urls."""
    vllm = VllmServer(ckpt, tmp, limit_mm={"image": 1, "video": 0}, extra_args=vllm_args, extra_env=vllm_env)
    started: dict[str, Cli] = {}
    try:
        for name, (extra, tree) in fronts.items():
            argv = ["--model", str(ckpt), "--port", "0", "--llm_url", vllm.url, "--device", "cpu", *extra]
            started[name] = Cli(
                argv, tmp / f"{ckpt.name}-{name}", extra_env={"PYTHONPATH": str(tree)}, cwd=tree
            )
            started[name].wait_ready(900)
        print(f"vLLM ready in {vllm.ready_s:.0f} s", flush=True)
        yield {"vllm": vllm.url, **{name: s.url for name, s in started.items()}}
        assert vllm.alive(), "vLLM died during the run"
    finally:
        for server in started.values():
            server.terminate()
        vllm.stop()


def cost_and_gain(args: argparse.Namespace, tmp: Path) -> list[dict]:
    profile = PROFILES["quick" if args.quick else "standard"]
    vision = {k: v for k, v in Checkpoint.demo().vision.items() if k != "out_hidden_size"}
    ckpt = make_servable_checkpoint("qwen2_5_vl", tmp / "ckpt", vision=vision, max_units=BUDGET)
    # a batch holds up to 8 images; each image is held to BUDGET by the checkpoint's own max_pixels
    front = ["--visual_batch_max_tokens", str(BUDGET * 8), "--cache_gb", "1"]
    points = []
    with serving(ckpt, tmp, {"vitserve": (front, ROOT)}) as urls:
        for url in urls.values():
            _warm(url, Bodies(str(ckpt), SIZES["448px"], seed=99))
        cases = [(w, c) for w in args.workloads.split(",") for c in profile["clients"]]
        for i, (name, clients) in enumerate(cases):
            with harness.sitting(workload=name, clients=clients) as point:
                for seed, arm in enumerate(harness.alternate(["vllm", "vitserve"], i), start=1 + 2 * i):
                    bodies = Bodies(str(ckpt), SIZES["448px"], seed, repeated=name == "repeated")
                    point[arm] = asyncio.run(run_point(urls[arm], bodies, clients, profile["duration_s"],
                                                       profile["max_requests"]))  # fmt: skip
            print(json.dumps({k: v for k, v in point.items() if k not in ("vllm", "vitserve")}), flush=True)
            points.append(point)
    print("\n".join(report.gateway_table({"points": points})))
    return points


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


def _width_point(url: str, bodies: Bodies, requests: int, vitserve: bool) -> dict:
    before = _metrics(url) if vitserve else {}
    result = asyncio.run(run_point(url, bodies, 1, 3600.0, requests))
    result.pop("ttft_s", None)
    if vitserve:
        delta = {k: v - before[k] for k, v in _metrics(url).items()}
        result["upstream_bytes"] = round(delta["bytes"] / max(delta["requests"], 1.0))
        if delta["handovers"]:  # a tree without the stage reports none
            result["handover_ms"] = round(1000 * delta["handover_s"] / delta["handovers"], 1)
    return result


def widths(args: argparse.Namespace, tmp: Path) -> list[dict]:
    transports, points = set(args.transports.split(",")), []
    if args.ec_tree == "none":
        transports.discard("ec_storage")
    for name in args.models.split(","):
        started = time.monotonic()
        family, text, vision = MODELS[name]
        ckpt = make_servable_checkpoint(family, tmp / name, vision=vision, max_units=MAX_UNITS, text=text)
        front = ["--dtype", args.dtype, "--visual_batch_max_tokens", str(MAX_UNITS), "--cache_gb", "0"]
        if transports & {"inline", "ec_storage"}:
            points += _ec_example_sitting(args, ckpt, tmp, front, transports)
        if "wire" in transports:
            points += _vitserve_connector_sitting(args, ckpt, tmp, front)
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print("\n".join(report.gateway_widths_table({"points": points})))
    return points


def _ec_example_sitting(args: argparse.Namespace, ckpt: Path, tmp: Path, front: list[str], transports: set[str]
                        ) -> list[dict]:  # fmt: skip
    """vLLM with ECExampleConnector on a directory in /dev/shm: vllm alone, inline and ec_storage."""
    ec_dir = Path(
        tempfile.mkdtemp(prefix="vitserve-ec-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    config = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
              "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)}}  # fmt: skip
    fronts = {"inline": (front, ROOT)} if "inline" in transports else {}
    if "ec_storage" in transports:
        ec = ["--llm_transport", "ec_storage", "--ec_storage_path", str(ec_dir)]
        fronts["ec_storage"] = ([*front, *ec], Path(args.ec_tree))
    vllm_args = ("--ec-transfer-config", json.dumps(config), "--max-model-len", "4096")
    try:
        return _sittings(args, ckpt, tmp, fronts, vllm_args, None, "ec_example")
    finally:
        shutil.rmtree(ec_dir, ignore_errors=True)  # RAM, on /dev/shm


def _vitserve_connector_sitting(
    args: argparse.Namespace, ckpt: Path, tmp: Path, front: list[str]
) -> list[dict]:
    """A second vLLM, with vitserve's own connector (one vLLM has one EC connector): vllm alone and wire.
    vLLM imports vitserve from a directory that holds only it (what `pip install --no-deps vitserve` gives)."""
    pkg = tmp / f"{ckpt.name}-pkg"
    pkg.mkdir(exist_ok=True)
    if not (pkg / "vitserve").exists():
        (pkg / "vitserve").symlink_to(ROOT / "vitserve")
    endpoint = f"tcp://127.0.0.1:{unused_port()}"  # bound a minute later: tests/vllm_server.py
    config = {"ec_connector": "VitserveECConnector", "ec_connector_module_path": "vitserve.vllm_connector",
              "ec_role": "ec_consumer", "ec_connector_extra_config": {"endpoint": endpoint, "max_gb": 4}}  # fmt: skip
    fronts = {"wire": ([*front, "--llm_transport", "wire", "--llm_endpoint", endpoint], ROOT)}
    vllm_args = ("--ec-transfer-config", json.dumps(config), "--max-model-len", "4096")
    return _sittings(args, ckpt, tmp, fronts, vllm_args, {"PYTHONPATH": str(pkg)}, "vitserve")


def _sittings(args: argparse.Namespace, ckpt: Path, tmp: Path, fronts: dict[str, tuple[list[str], Path]],
              vllm_args: tuple[str, ...], vllm_env: dict[str, str] | None, connector: str) -> list[dict]:  # fmt: skip
    """One vLLM (and `fronts` before it); per image size, every arm in alternating order: one point each."""
    requests, points = 2 if args.quick else 4, []
    with serving(ckpt, tmp, fronts, vllm_args, vllm_env) as urls:
        for i, size in enumerate(("448px", "1080p")):
            with harness.sitting(model=ckpt.name, size=size, connector=connector) as point:
                for seed, arm in enumerate(harness.alternate(list(urls), i), start=10 * i):
                    _warm(urls[arm], Bodies(str(ckpt), SIZES[size], 900 + seed, max_tokens=4))
                    bodies = Bodies(str(ckpt), SIZES[size], seed, max_tokens=4)
                    point[arm] = _width_point(urls[arm], bodies, requests, arm != "vllm")
            print(json.dumps(point), flush=True)
            points.append(point)
    return points


def main() -> None:
    ap = harness.parser(__doc__, quick="a few requests per point")
    ap.add_argument("--widths", action="store_true", help="the hand-over at real LLM widths (see above)")
    ap.add_argument("--workloads", default="unique,repeated", help="without --widths: unique and/or repeated")
    ap.add_argument("--models", default=",".join(MODELS), help="with --widths: the checkpoints")
    ap.add_argument("--dtype", default="bfloat16", help="with --widths: vitserve's --dtype")
    ap.add_argument(
        "--transports",
        default="inline,ec_storage,wire",
        help="with --widths: the vitserve transports measured (wire on a second vLLM, see above)",
    )
    ap.add_argument("--ec_tree", default=str(ROOT),
                    help="with --widths: the vitserve tree whose ec_storage is measured; 'none' leaves it out")  # fmt: skip
    args = ap.parse_args()
    run = harness.begin("gateway_widths" if args.widths else "gateway", args)
    with tempfile.TemporaryDirectory(prefix="vitserve-gateway-") as tmp:
        points = (widths if args.widths else cost_and_gain)(args, Path(tmp))
    harness.finish(run, {"points": points}, args)


if __name__ == "__main__":
    main()
