"""The front door against vLLM alone, in front of the same vLLM in one sitting: what it costs and what it gains.

    python bench/gateway.py --quick             # a smoke run (a few requests per point)
    python bench/gateway.py                     # RESULTS.md's profile (1 and 8 clients, two workloads)
    python bench/gateway.py --widths            # the hand-over at real LLM widths, 448 px and 1080p
    python bench/gateway.py --widths --quick    # 2 rounds per point
    python bench/gateway.py --widths --ec_tree DIR   # ec_storage from another vitserve tree
    python bench/gateway.py --widths --transports wire,pull   # only the sitting on vitserve's connector
    python bench/gateway.py --balancer          # two vLLMs behind nginx, 8 clients (bench/gateway_balancer.py)

Compared arms, clients closed-loop and streaming (bench/gateway_parts.py); the time to first token is the time
to the first event that carries content:
- vllm: the raw image straight to vLLM (its own tower);
- vitserve: the real `vitserve --llm_url` CLI (a subprocess) in front of that vLLM; with --widths, two of them:
  inline (the embedding base64 in the body) and ec_storage (the embedding in a file, a metadata-only part);
- with --widths, wire and pull on a second vLLM (one vLLM has one EC connector) whose connector is
  vitserve's own (vitserve.vllm_connector), pushed to and pulling at once: wire, `--llm_transport wire`
  pushing each embedding over ZMQ (TCP loopback) to the connector's endpoint; pull, `--llm_transport pull`
  keeping it for the connector to fetch from vitserve's producer (`--pull_bind` on loopback; `pull_from`
  loopback), each against vllm alone on that same vLLM. Each point names its vLLM's connector (`connector`:
  ec_example or vitserve); `--transports` leaves arms out.

Default (record `gateway`): one tiny Qwen2.5-VL checkpoint (tests/checkpoints.py make_servable_checkpoint)
with the demo's realistic-width tower (8 blocks of 512) and a one-layer 64-wide LLM, so the tower is most of
the work, as in a real deployment's prefill; 448 px images, each point's two arms in alternating order
(bench/harness.py). Workloads:
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
wire and pull, of vitserve's connector (endpoint on a free loopback port, max_gb 4, no key; `--keyed`: a
key_file, vitserve's --wire_key_file). One client, a new image per request, per image size: one warm-up per
arm, then `--rounds` rounds (default 8) of one request per arm, each round's order rotated so every arm goes
first equally often. Per point and arm: ttft p50 (p90 from
10 rounds, p99 from 100), the ratio to vLLM alone of the same vLLM (the table), upstream bytes per request and
vitserve's hand-over (`vitserve_upstream_body_bytes`, `vitserve_stage_seconds{stage="handover"}`; for pull,
vitserve keeping the item: the fetch runs in vLLM once it schedules the request and shows in the ttft only).
In the record, not the table: per arm `in_vllm_ms`, the means of vLLM's own per-request times (its ttft from
arrival, queue, prefill: read around each request, one client), and for pull `fetch_ms`, the connector's mean
fetch (`vllm:vitserve_connector_pull_ms_total` / `..._pull_kept_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gateway_balancer, harness, report  # noqa: E402
from bench import gateway_parts as parts  # noqa: E402
from bench.gateway_parts import MAX_UNITS, MODELS, Bodies  # noqa: E402
from bench.workloads import SIZES  # noqa: E402
from tests.checkpoints import make_servable_checkpoint  # noqa: E402
from tests.cli import Cli  # noqa: E402
from tests.vllm_server import VllmServer, unused_port  # noqa: E402
from vitserve.checkpoint import Checkpoint  # noqa: E402

BUDGET = 256  # tokens per image (after merge): a 448x448 image; the default checkpoint's max_pixels
PROFILES = {  # clients, seconds per point, request cap per point
    "quick": {"clients": (1, 8), "duration_s": 10.0, "max_requests": 8},
    "standard": {"clients": (1, 8), "duration_s": 40.0, "max_requests": 200},
}


@contextmanager
def serving(ckpt: Path, tmp: Path, fronts: dict[str, tuple[list[str], Path]], vllm_args: tuple[str, ...] = (),
            vllm_env: dict[str, str] | None = None, keep_log: Path | None = None) -> Iterator[dict[str, str]]:  # fmt: skip
    """One vLLM and, in front of it, one vitserve per `fronts` entry (name: its arguments, its tree); the urls.
    `keep_log`: where vLLM's log is copied when it stops."""
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
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(vllm.log_path, keep_log)


def cost_and_gain(args: argparse.Namespace, tmp: Path) -> list[dict]:
    profile = PROFILES["quick" if args.quick else "standard"]
    vision = {k: v for k, v in Checkpoint.demo().vision.items() if k != "out_hidden_size"}
    ckpt = make_servable_checkpoint("qwen2_5_vl", tmp / "ckpt", vision=vision, max_units=BUDGET)
    # a batch holds up to 8 images; each image is held to BUDGET by the checkpoint's own max_pixels
    front = ["--visual_batch_max_tokens", str(BUDGET * 8), "--cache_gb", "1"]
    points = []
    with serving(ckpt, tmp, {"vitserve": (front, ROOT)}) as urls:
        for url in urls.values():
            parts.warm(url, Bodies(str(ckpt), SIZES["448px"], seed=99))
        cases = [(w, c) for w in args.workloads.split(",") for c in profile["clients"]]
        for i, (name, clients) in enumerate(cases):
            with harness.sitting(workload=name, clients=clients) as point:
                for seed, arm in enumerate(harness.alternate(["vllm", "vitserve"], i), start=1 + 2 * i):
                    bodies = Bodies(str(ckpt), SIZES["448px"], seed, repeated=name == "repeated")
                    point[arm] = asyncio.run(parts.run_point(urls[arm], bodies, clients, profile["duration_s"],
                                                             profile["max_requests"]))  # fmt: skip
            print(json.dumps({k: v for k, v in point.items() if k not in ("vllm", "vitserve")}), flush=True)
            points.append(point)
    print("\n".join(report.gateway_table({"points": points})))
    return points


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
        if transports & {"wire", "pull"}:
            points += _vitserve_connector_sitting(args, ckpt, tmp, front, transports)
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
    args: argparse.Namespace, ckpt: Path, tmp: Path, front: list[str], transports: set[str]
) -> list[dict]:
    """A second vLLM, with vitserve's own connector (one vLLM has one EC connector), pushed to and pulling at
    once: vllm alone, wire (pushed to its endpoint) and pull (fetched by it from vitserve's producer)."""
    endpoint = f"tcp://127.0.0.1:{unused_port()}"  # bound a minute later: tests/vllm_server.py
    extra: dict[str, object] = {"endpoint": endpoint, "max_gb": 4, "pull_from": ["127.0.0.0/8"]}
    if args.keyed:  # CURVE on every connection, as across hosts (on one host wire's bytes still go by file)
        key_file = tmp / f"{ckpt.name}.key"
        key_file.write_text(secrets.token_hex(32))
        extra["key_file"] = str(key_file)
        front = [*front, "--wire_key_file", str(key_file)]
    fronts = {}
    if "wire" in transports:
        fronts["wire"] = ([*front, "--llm_transport", "wire", "--llm_endpoint", endpoint], ROOT)
    if "pull" in transports:  # the producer binds on loopback
        bind = f"tcp://127.0.0.1:{unused_port()}"
        fronts["pull"] = ([*front, "--llm_transport", "pull", "--pull_bind", bind], ROOT)
    pkg = parts.vitserve_package(tmp, ckpt.name)
    env = {"PYTHONPATH": str(pkg)}
    return _sittings(args, ckpt, tmp, fronts, parts.connector_args(extra), env, "vitserve")


def _sittings(args: argparse.Namespace, ckpt: Path, tmp: Path, fronts: dict[str, tuple[list[str], Path]],
              vllm_args: tuple[str, ...], vllm_env: dict[str, str] | None, connector: str) -> list[dict]:  # fmt: skip
    """One vLLM (and `fronts` before it); per image size, one point: every arm's `--rounds` requests."""
    points = []
    keep_log = None
    if args.iterations:  # vLLM logs each engine step: its context tokens and elapsed ms, in order
        vllm_args = (*vllm_args, "--enable-logging-iteration-details")
        vllm_env = {**(vllm_env or {}), "VLLM_LOGGING_LEVEL": "INFO"}  # the lines are INFO
        keep_log = Path(args.iterations) / f"vllm-{ckpt.name}-{connector}.log"
    with serving(ckpt, tmp, fronts, vllm_args, vllm_env, keep_log) as urls:
        for i, size in enumerate(("448px", "1080p")):
            with harness.sitting(
                model=ckpt.name, size=size, connector=connector, rounds=args.rounds
            ) as point:
                point.update(_rounds(urls, str(ckpt), SIZES[size], args.rounds, 10 * i, args.gap_s))
            print(json.dumps({k: ({a: b for a, b in v.items() if a != "ttft_s"} if isinstance(v, dict) else v)
                              for k, v in point.items()}), flush=True)  # fmt: skip
            points.append(point)
    return points


def _one_request(urls: dict[str, str], arm: str, bodies: Bodies, inside: dict[str, float]) -> dict:
    """One request of `arm`; what vLLM says of it (its /metrics sums) and the CPU seconds its engine core and worker
    spent meanwhile are added to `inside` (one client: the counters move for this request only)."""
    was, cpu = parts.vllm_times(urls["vllm"]), parts.vllm_cpu_s()
    one = asyncio.run(parts.run_point(urls[arm], bodies, 1, 3600.0, 1))
    for k, v in parts.vllm_times(urls["vllm"]).items():
        inside[k] = inside.get(k, 0.0) + v - was[k]
    for k, v in parts.vllm_cpu_s().items():
        inside[f"cpu_{k}"] = inside.get(f"cpu_{k}", 0.0) + v - cpu[k]
    return one


def _rounds(
    urls: dict[str, str], model: str, size: tuple[int, int], rounds: int, seed: int, gap_s: float = 0.0
) -> dict[str, dict]:
    """One warm-up request per arm, then `rounds` rounds of one request per arm, each round's order rotated so
    every arm goes first equally often (a change of load meanwhile favours none). One client, a new image
    per request. Per arm: ttft p50 (p90 / p99 as far as the rounds reach), errors, and for a vitserve arm
    its upstream bytes and hand-over stage over its requests."""
    arms = list(urls)
    for k, arm in enumerate(arms):
        parts.warm(urls[arm], Bodies(model, size, 900 + seed + k, max_tokens=4))
    bodies = {arm: Bodies(model, size, seed + k, max_tokens=4) for k, arm in enumerate(arms)}
    ttft: dict[str, list[float]] = {arm: [] for arm in arms}
    errors: dict[str, dict[str, int]] = {arm: {} for arm in arms}
    before = {arm: parts.metrics(urls[arm]) for arm in arms if arm != "vllm"}
    fetched = parts.fetches(urls["vllm"]) if "pull" in arms else (0.0, 0.0)
    inside: dict[str, dict[str, float]] = {arm: {} for arm in arms}  # vLLM's own times of each arm's requests
    for r in range(rounds):
        for arm in harness.rotate(arms, r):
            time.sleep(gap_s)  # --gap_s: vLLM's engine core idle again before each request (see the option)
            one = _one_request(urls, arm, bodies[arm], inside[arm])
            ttft[arm] += one["ttft_s"]
            for kind, n in one["errors"].items():
                errors[arm][kind] = errors[arm].get(kind, 0) + n
    out = {}
    for arm in arms:
        out[arm] = {
            "requests": len(ttft[arm]),
            "errors": errors[arm],
            **parts.tails(ttft[arm]),
            "ttft_s": ttft[arm],
        }
        n = inside[arm].get("requests") or 0.0
        if n:  # means over the arm's requests, in ms: what vLLM says of them
            out[arm]["in_vllm_ms"] = {
                k: round(1000 * v / n, 1) for k, v in inside[arm].items() if k != "requests"
            }
        if arm in before:
            out[arm].update(parts.handover(before[arm], parts.metrics(urls[arm])))
    if "pull" in arms:  # what the connector's fetches took inside vLLM, once it scheduled each request
        kept, ms = (b - a for a, b in zip(fetched, parts.fetches(urls["vllm"]), strict=True))
        out["pull"]["fetch_ms"] = round(ms / kept, 1) if kept else None
    return out


TRANSPORTS = ("inline", "ec_storage", "wire", "pull")
WIDTHS_ROUNDS = 8  # issue 51: 4 rounds were too noisy to separate 0.97x from 1.37x


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked, with --rounds' default of the profile chosen."""
    ap = harness.parser(__doc__, quick="a few requests per point")
    ap.add_argument("--widths", action="store_true", help="the hand-over at real LLM widths (see above)")
    ap.add_argument("--balancer", action="store_true",
                    help="two vLLMs behind nginx, two vitserve replicas pulling (bench/gateway_balancer.py)")  # fmt: skip
    ap.add_argument("--workloads", default="unique,repeated", help="without --widths: unique and/or repeated")
    ap.add_argument("--models", default=",".join(MODELS), help="with --widths: the checkpoints")
    ap.add_argument("--dtype", default="bfloat16", help="with --widths or --balancer: vitserve's --dtype")
    ap.add_argument("--size", default="1080p", choices=sorted(SIZES), help="with --balancer: the image size")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help="with --widths: the vitserve transports measured (wire and pull on a second vLLM)")  # fmt: skip
    ap.add_argument("--keyed", action="store_true",
                    help="with --widths: the connector keyed (key_file; vitserve --wire_key_file), as across hosts")  # fmt: skip
    ap.add_argument("--ec_tree", default=str(ROOT),
                    help="with --widths: the vitserve tree whose ec_storage is measured; 'none' leaves it out")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"with --widths: requests per arm and point (default {WIDTHS_ROUNDS}, --quick 2); with "
                         f"--balancer: windows per arm (default {gateway_balancer.ROUNDS}, --quick 2)")  # fmt: skip
    ap.add_argument("--iterations", default=None, metavar="DIR",
                    help="with --widths: vLLM logs every engine step (--enable-logging-iteration-details) and its "
                         "log is kept in DIR: which steps each request took, and each step's time")  # fmt: skip
    ap.add_argument("--gap_s", type=float, default=0.0,
                    help="with --widths: seconds between requests. vLLM's engine core busy-waits (sched_yield) for "
                         "the worker's output for 1 s after its last step (shm_broadcast's SpinCondition), on a "
                         "core the worker's prefill then shares: a request that reaches vLLM within 1 s of the "
                         "previous one's end pays it (vLLM alone always does back to back; wire, which reaches "
                         "vLLM after vitserve's own encode, never). 1.5 puts every arm after an idle engine")  # fmt: skip
    args = ap.parse_args(argv)
    if args.widths and args.balancer:
        ap.error("--widths and --balancer are two profiles: give one")
    unknown = sorted(set(args.transports.split(",")) - set(TRANSPORTS))
    if unknown:
        ap.error(f"--transports takes {', '.join(TRANSPORTS)}, not {', '.join(unknown)}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else (gateway_balancer.ROUNDS if args.balancer else WIDTHS_ROUNDS)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    return args


def main() -> None:
    args = options()
    name = "gateway_widths" if args.widths else "gateway_balancer" if args.balancer else "gateway"
    run = harness.begin(name, args)
    profile = widths if args.widths else gateway_balancer.balancer if args.balancer else cost_and_gain
    with tempfile.TemporaryDirectory(prefix="vitserve-gateway-") as tmp:
        points = profile(args, Path(tmp))
    harness.finish(run, {"points": points}, args)


if __name__ == "__main__":
    main()
