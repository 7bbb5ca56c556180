"""What bench/gateway.py's profiles share: the checkpoints at real widths, the chat bodies, the closed-loop
streaming clients, vitserve's counters read around a request, and vLLM with vitserve's own connector.

The time to first token is the time to the first streamed event that carries content.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import harness
from bench.workloads import gradient_png
from tests.checkpoints import VISION_CONFIGS
from tests.openai_chat import data_url

ROOT = harness.ROOT
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


def _count(errors: dict[str, int], kind: str) -> None:
    errors[kind] = errors.get(kind, 0) + 1


async def _one(http: httpx.AsyncClient, url: str, body: dict, out: dict) -> None:
    t0 = time.monotonic()
    first = None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                _count(out["errors"], str(r.status_code))
                await r.aread()
                return
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - t0
    except httpx.HTTPError as exc:
        _count(out["errors"], type(exc).__name__)
        return
    out["ttft_s"].append(first if first is not None else time.monotonic() - t0)
    out["total_s"].append(time.monotonic() - t0)


async def run_point(
    url: str | Sequence[str], bodies: Bodies, clients: int, duration_s: float, cap: int
) -> dict:
    """`clients` closed-loop streaming clients until `duration_s` passed or `cap` requests were issued. With
    several urls, client k sends to url k mod their number (clients split over replicas)."""
    urls = [url] if isinstance(url, str) else list(url)
    out: dict = {"ttft_s": [], "total_s": [], "errors": {}}
    issued = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient, mine: str) -> None:
        nonlocal issued
        while time.monotonic() < deadline and issued < cap:
            issued += 1
            await _one(http, mine, bodies.next(), out)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        await asyncio.gather(*(client(http, urls[k % len(urls)]) for k in range(clients)))
    elapsed = time.monotonic() - start
    done = len(out["ttft_s"])
    return {"requests": done, "errors": out["errors"], "elapsed_s": round(elapsed, 3),
            "req_per_s": round(done / elapsed, 4) if elapsed else 0.0, "ttft_p50_s": harness.pct(out["ttft_s"], 50),
            "ttft_p99_s": harness.pct(out["ttft_s"], 99), "ttft_s": [round(x, 4) for x in out["ttft_s"]]}  # fmt: skip


def warm(url: str, bodies: Bodies) -> None:
    """One request before timing: first-call costs (compilation, pools) are not the steady state."""
    body = {**bodies.next(), "stream": False}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=600, trust_env=False).raise_for_status()


def tails(ttft_s: Sequence[float]) -> dict[str, float | None]:
    """ttft p50, and p90 / p99 where the samples reach that far (10 / 100 of them: one past the quantile)."""
    out: dict[str, float | None] = {"ttft_p50_s": harness.pct(ttft_s, 50)}
    for q in (90, 99):
        if len(ttft_s) * (100 - q) >= 100:
            out[f"ttft_p{q}_s"] = harness.pct(ttft_s, q)
    return out


def metrics(url: str) -> dict[str, float]:
    """vitserve's counters of upstream body bytes and of every stage's time (0 where a tree has none):
    `<stage>_s` and `<stage>s` (the count) for each vitserve_stage_seconds{stage} it exports."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    want = {"vitserve_upstream_body_bytes_sum": "bytes", "vitserve_upstream_body_bytes_count": "requests"}
    out = {"bytes": 0.0, "requests": 0.0, "handover_s": 0.0, "handovers": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        stage = re.fullmatch(r'vitserve_stage_seconds_(sum|count)\{stage="(\w+)"\}', name)
        if stage:
            out[stage[2] + ("_s" if stage[1] == "sum" else "s")] = float(value)
        elif name in want:
            out[want[name]] = float(value)
    return out


VLLM_TIMES = {  # vLLM's own per-request histograms: where a request's time went inside the engine
    "vllm:time_to_first_token_seconds_sum": "vllm_ttft_s",  # from its arrival at the engine
    "vllm:request_queue_time_seconds_sum": "queue_s",  # waiting to be scheduled (a pull's fetch included)
    "vllm:request_prefill_time_seconds_sum": "prefill_s",  # scheduled to first token (the load included)
    "vllm:request_queue_time_seconds_count": "requests",
}


def vllm_times(url: str) -> dict[str, float]:
    """VLLM_TIMES' sums from a vLLM's /metrics, summed over engines."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    out = dict.fromkeys(VLLM_TIMES.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in VLLM_TIMES:
            out[VLLM_TIMES[name]] += float(line.rpartition(" ")[2])
    return out


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
VLLM_PROCESSES = {"VLLM::EngineCor": "engine_core", "VLLM::Worker": "worker"}  # their names (comm) in /proc


def vllm_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this machine's vLLM engine-core and worker processes (one vLLM
    at a time in these benches), read from /proc: around one request, what each side of vLLM spent on it."""
    out = dict.fromkeys(VLLM_PROCESSES.values(), 0.0)
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name in VLLM_PROCESSES:
            out[VLLM_PROCESSES[name]] += (int(fields[11]) + int(fields[12])) / _TICK
    return out


def fetches(url: str) -> tuple[float, float]:
    """(fetches kept, their milliseconds) from a vLLM's /metrics: vitserve's connector's pull counters, summed over
    engines (0, 0 where it has none)."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    totals = {"vllm:vitserve_connector_pull_kept_total": 0.0, "vllm:vitserve_connector_pull_ms_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rpartition(" ")[2])
    return tuple(totals.values())  # type: ignore[return-value]


def handover(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Upstream bytes per request, the hand-over stage's mean (ms) and every stage's mean (`stages_ms`: where
    vitserve's time went before vLLM saw the request) between two `metrics` readings."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out: dict[str, Any] = {"upstream_bytes": round(delta["bytes"] / max(delta["requests"], 1.0))}
    if delta["handovers"]:  # a tree without the stage reports none
        out["handover_ms"] = round(1000 * delta["handover_s"] / delta["handovers"], 1)
    stages = {
        k[:-2]: delta[k] / delta[k[:-2] + "s"] for k in delta if k.endswith("_s") and delta.get(k[:-2] + "s")
    }
    if stages:
        out["stages_ms"] = {k: round(1000 * v, 1) for k, v in sorted(stages.items())}
    return out


def vitserve_package(tmp: Path, name: str) -> Path:
    """A directory holding only vitserve (what `pip install --no-deps vitserve` gives vLLM): its PYTHONPATH."""
    pkg = tmp / f"{name}-pkg"
    pkg.mkdir(exist_ok=True)
    if not (pkg / "vitserve").exists():
        (pkg / "vitserve").symlink_to(ROOT / "vitserve")
    return pkg


def connector_args(extra: dict[str, Any]) -> tuple[str, ...]:
    """vLLM's arguments for vitserve's connector (by module path) with `extra` as its extra config, and a
    context a 1080p image fits in."""
    config = {"ec_connector": "VitserveECConnector", "ec_connector_module_path": "vitserve.vllm_connector",
              "ec_role": "ec_consumer", "ec_connector_extra_config": extra}  # fmt: skip
    return ("--ec-transfer-config", json.dumps(config), "--max-model-len", "4096")
