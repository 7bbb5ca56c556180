"""bench/gateway.py --balancer (record `gateway_balancer`): vLLM engines behind a balancer, each request's
embedding pulled by whichever engine gets it from the vitserve replica the request names (docs/vllm.md, "Pull").

    python bench/gateway.py --balancer            # 4 windows of 90 s per arm, 8 clients, 1080p
    python bench/gateway.py --balancer --quick    # 2 windows of 10 s per arm: a smoke run

Two real vLLMs serving one checkpoint (bench/gateway_parts.py's qwen2_5_vl-3584: Qwen2.5-VL-7B's width 3,584, a
one-layer LLM, a tiny tower), each with vitserve's connector pulling (no endpoint; `pull_from` loopback, no key),
behind a real nginx round robin (tests/nginx_server.py, without its retry: a failed request counts as one); two
`vitserve --llm_transport pull` replicas, nginx as their `--llm_url`, each its producer on a loopback port.
Arms, CLIENTS closed-loop streaming clients each, a new image per request (`--size`, default 1080p):
- pull: the clients split over the two replicas (client k to replica k mod 2);
- vllm: the same two engines given the raw image through the same nginx.
The arms take turns, one window each per round, each first as often as the other. Per arm, over its windows:
requests per second (requests done / the windows' seconds, each window drained of its requests), ttft p50 /
p99, errors, the requests each engine answered (nginx's access log) and the replicas' hand-over stage.
Memory: two vLLMs of 1 GiB of KV cache each and two small-tower vitserves fit in 24 GiB with room.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench import gateway_parts as parts
from bench import harness
from bench.workloads import SIZES
from tests.checkpoints import make_servable_checkpoint
from tests.cli import Cli
from tests.nginx_server import NginxServer
from tests.vllm_server import VllmServer, unused_port

MODEL = "qwen2_5_vl-3584"
CLIENTS = 8
ROUNDS = 4  # windows per arm (--rounds); --quick: 2
WINDOW_S = {"quick": 10.0, "standard": 90.0}  # each window then drains (tens of s at 1080p)
ARMS = ("vllm", "pull")


@contextmanager
def stack(ckpt: Path, tmp: Path, dtype: str) -> Iterator[dict[str, Any]]:
    """Two vLLMs (pulling), nginx over them, two vitserve replicas pulling through it: urls and nginx."""
    env = {"PYTHONPATH": str(parts.vitserve_package(tmp, ckpt.name))}
    vllm_args = parts.connector_args({"max_gb": 4, "pull_from": ["127.0.0.0/8"]})
    engines: list[VllmServer] = []
    replicas: list[Cli] = []
    nginx = None
    try:
        for _ in range(2):  # started together, waited for after
            engines.append(VllmServer(ckpt, tmp, limit_mm={"image": 1, "video": 0}, extra_args=vllm_args,
                                      extra_env=env, wait=False))  # fmt: skip
        for engine in engines:
            engine.wait_ready()
        try:
            nginx = NginxServer(tmp / "nginx", [f"127.0.0.1:{e.port}" for e in engines], retry=False).start()
        except pytest.skip.Exception as exc:  # no nginx here: tests/nginx_server.py says how to install it
            raise SystemExit(f"--balancer needs nginx: {exc}") from None
        front = ["--dtype", dtype, "--visual_batch_max_tokens", str(parts.MAX_UNITS), "--cache_gb", "0"]
        for k in range(2):
            bind = f"tcp://127.0.0.1:{unused_port()}"
            argv = ["--model", str(ckpt), "--port", "0", "--llm_url", nginx.url, "--device", "cpu", *front,
                    "--llm_transport", "pull", "--pull_bind", bind]  # fmt: skip
            replicas.append(Cli(argv, tmp / f"replica{k}", cwd=parts.ROOT))
        for replica in replicas:
            replica.wait_ready(900)
        print(f"vLLMs ready in {', '.join(f'{e.ready_s:.0f}' for e in engines)} s", flush=True)
        yield {"vllm": nginx.url, "pull": [r.url for r in replicas], "nginx": nginx,
               "engines": [f"127.0.0.1:{e.port}" for e in engines]}  # fmt: skip
        assert all(e.alive() for e in engines), "a vLLM died during the run"
    finally:
        for replica in replicas:
            with contextlib.suppress(AssertionError):
                replica.terminate()
        if nginx is not None:
            nginx.stop()
        for engine in engines:
            engine.stop()


def _served(nginx: NginxServer, since: int, engines: list[str]) -> list[int]:
    """Per engine, the proxied requests it answered from the `since`-th on (the last upstream nginx tried)."""
    last = Counter(tries[-1] for tries in nginx.upstreams()[since:] if tries)
    return [last[e] for e in engines]


def balancer(args: argparse.Namespace, tmp: Path) -> list[dict]:
    family, text, vision = parts.MODELS[MODEL]
    ckpt = make_servable_checkpoint(family, tmp / MODEL, vision=vision, max_units=parts.MAX_UNITS, text=text)
    size, window_s = SIZES[args.size], WINDOW_S["quick" if args.quick else "standard"]
    with stack(ckpt, tmp, args.dtype) as s:
        urls: dict[str, list[str]] = {"vllm": [s["vllm"]], "pull": s["pull"]}
        for k, url in enumerate([*urls["pull"], s["vllm"]]):  # each replica's path to each engine, and raw
            for j in range(2):
                parts.warm(url, parts.Bodies(str(ckpt), size, 900 + 2 * k + j, max_tokens=4))
        bodies = {arm: parts.Bodies(str(ckpt), size, seed, max_tokens=4) for seed, arm in enumerate(ARMS, 1)}
        before = [parts.metrics(u) for u in urls["pull"]]
        with harness.sitting(model=MODEL, size=args.size, clients=CLIENTS, rounds=args.rounds,
                             window_s=window_s) as point:  # fmt: skip
            windows = _windows(args.rounds, window_s, urls, bodies, s)
        for arm in ARMS:
            point[arm] = _summary(windows[arm])
        after = [parts.metrics(u) for u in urls["pull"]]
        point["pull"].update(parts.handover(_sum(before), _sum(after)))
    point["windows"] = {
        arm: [{k: v for k, v in w.items() if k != "ttft_s"} for w in windows[arm]] for arm in ARMS
    }
    print(json.dumps({k: v for k, v in point.items() if k not in ("windows", *ARMS)} | {
        arm: {k: v for k, v in point[arm].items() if k != "ttft_s"} for arm in ARMS}), flush=True)  # fmt: skip
    print("\n".join(table({"points": [point]})))
    return [point]


def _windows(rounds: int, window_s: float, urls: dict[str, list[str]], bodies: dict[str, parts.Bodies],
             s: dict[str, Any]) -> dict[str, list[dict]]:  # fmt: skip
    """`rounds` rounds of one window per arm, in alternating order; each window's result and engines served."""
    out: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in harness.alternate(ARMS, r):
            since = len(s["nginx"].upstreams())
            window = asyncio.run(parts.run_point(urls[arm], bodies[arm], CLIENTS, window_s, 10**9))
            window["per_engine"] = _served(s["nginx"], since, s["engines"])
            window["load"] = round(harness.load(), 2)
            print(f"round {r} {arm}: {window['requests']} requests, {window['req_per_s']} req/s, "
                  f"ttft p50 {window['ttft_p50_s']} s, per engine {window['per_engine']}", flush=True)  # fmt: skip
            out[arm].append(window)
    return out


def _summary(windows: list[dict]) -> dict[str, Any]:
    ttft = [x for w in windows for x in w["ttft_s"]]
    elapsed = sum(w["elapsed_s"] for w in windows)
    errors: Counter[str] = Counter()
    for w in windows:
        errors.update(w["errors"])
    return {"requests": len(ttft), "elapsed_s": round(elapsed, 3),
            "req_per_s": round(len(ttft) / elapsed, 4) if elapsed else 0.0,
            "ttft_p50_s": harness.pct(ttft, 50), "ttft_p99_s": harness.pct(ttft, 99), "errors": dict(errors),
            "per_engine": [sum(col) for col in zip(*(w["per_engine"] for w in windows), strict=True)],
            "ttft_s": ttft}  # fmt: skip


def _sum(readings: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in readings) for k in readings[0]}


def table(res: dict) -> list[str]:
    """Per arm, requests/s and ttft p50 / p99 against vLLM alone's (raw images through the same nginx to the
    same two engines), and the requests each engine answered."""

    def f(x: float | None, digits: int) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    rows = []
    for p in res["points"]:
        for arm in ARMS:
            r, keys = p[arm], ("req_per_s", "ttft_p50_s", "ttft_p99_s")
            base = p["vllm"]
            vs = [
                "-" if arm == "vllm" or not (base[k] and r[k]) else f"**{r[k] / base[k]:.2f}x**" for k in keys
            ]
            rows.append([p["size"], arm, r["requests"], f(r["req_per_s"], 3), vs[0],
                         f"{f(r['ttft_p50_s'], 2)} / {f(r['ttft_p99_s'], 2)}", vs[1], vs[2],
                         " / ".join(map(str, r["per_engine"])), f(r.get("handover_ms"), 1),
                         sum(r["errors"].values()), f(p["load_before"], 1)])  # fmt: skip
    head = ["image", "arm", "requests", "req/s", "req/s / vLLM alone", "ttft p50 / p99 (s)", "p50 / vLLM alone",
            "p99 / vLLM alone", "requests per engine", "vitserve hand-over (ms)", "errors", "load"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return [*lines, *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), "",
            f"{CLIENTS} closed-loop clients per arm; vllm: raw images through nginx to the two engines; pull: two "
            "vitserve replicas pulling (the clients split over them), nginx as their --llm_url."]  # fmt: skip
