"""One client, sequential requests: where a request's time goes in vitserve, against the naive loop.

    python bench/latency.py                          # 224-px JPEGs (150 rounds) and 640x480 (20 rounds)
    python bench/latency.py --quick                  # a smoke run (20 and 2 rounds)
    python bench/latency.py --before /tmp/old        # also an older vitserve tree, interleaved
    python bench/latency.py --rounds 24 --large_rounds 0   # issue 23's test: 24 small images, one by one

Starts `vitserve --model demo --visual_batch_max_tokens 4096` (the real CLI) and bench/baseline_server.py
at the same budget (same seeded weights), and with --before a second vitserve run from another tree (e.g.
`git archive <commit> | tar -x -C /tmp/old`; its own code on PYTHONPATH), so a change is measured before
and after in one sitting. Beside them, `inprocess`: plain transformers in this process, no HTTP (PIL decode,
the HF processor, `model.visual`, the same thread count), what a user compares against first. Each round
runs each of them once in turn, rotating which goes first, so every one sees the same background load, with
a pause after each (GAP_S) so that no one's idle OpenMP threads still spin into the next one's request.
Stages per request, median and p90 in ms:

- client side, a raw socket (no HTTP library): connect, request written, first response byte, headers,
  body complete. The headers -> body gap is where a Nagle stall would show (~40 ms): a server-side timer
  cannot see it;
- server side, vitserve's own vitserve_stage_seconds: /metrics is scraped before and after every request,
  and with one request at a time the increase of a stage's _sum is that request's time
  (vitserve/api/encode.py; `forward` is rank 0's own timer); the naive server's own timing_ms;
- in-process: decode + preprocess (prep) and the forward, timed around the calls;
- derived: pool hops = prepare - decode - preprocess; ZMQ + rank hop = encode (dispatch -> result) -
  forward; outside the handler = client total - request (HTTP parse, middleware, response write, kernel);
  outside the forward = client total - forward - decode - preprocess (target <= 5 ms median).

Issue 23's two ratios are printed per size and recorded (`vs_inprocess`): vitserve's client p50 over the
in-process p50 (target <= 1.0 on small images) and its `encode` stage (dispatch -> result, the rank's
forward and the hop) over the in-process forward (target <= 0.95).

OpenMP: every server gets what the CLI gives its ranks (vitserve/cli.py `openmp_defaults`: PASSIVE threads
that spin ~30 us first) unless this process sets `OMP_WAIT_POLICY`, so the naive server's threads wait alike;
this process keeps the environment it was started with, so the in-process baseline runs as a user's script
would (libgomp's default: spin ~3 ms, then sleep).

The record (bench/harness.py) goes to bench/out/latency.jsonl; bench/report.py prints its table.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.loadgen import json_bodies  # noqa: E402
from bench.serve import launched as serve_launched  # noqa: E402
from bench.workloads import photos  # noqa: E402
from vitserve.cli import openmp_defaults  # noqa: E402

BUDGET = 4096
GAP_S = 0.05  # after each request: libgomp's default spin (~3 ms, more on a slow core) is over by then


def server_env() -> dict[str, str]:
    """The OpenMP settings for every server: the CLI's defaults for its ranks, or what this process sets."""
    env = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    openmp_defaults(env)
    return env


SERVER_STAGES = ("read", "parse", "prepare", "decode", "preprocess", "engine", "queue", "encode", "forward",
                 "respond", "request")  # fmt: skip
_STAGE_SUM = re.compile(r'^vitserve_stage_seconds_sum\{stage="(\w+)"\}\s+(\S+)$', re.MULTILINE)


@contextlib.contextmanager
def launched(kind: str, budget: int, log_path: Path, tree: Path = ROOT) -> Iterator[int]:
    """One server as a subprocess, its code from `tree` (this checkout unless --before); yields its port."""
    with serve_launched(kind, budget, threads(), log_path, tree=tree, env=server_env()) as url:
        yield int(url.rsplit(":", 1)[1])


def threads() -> int:
    """Torch threads for the naive server and the in-process baseline: all cores, as the rank gets at tp=dp=1."""
    return max(1, os.cpu_count() or 1)


class InProcess:
    """Plain transformers in this process, no HTTP: PIL decode, the HF processor, `model.visual`.

    The same processor settings (bench/baseline_server.py naive_processor) and seeded weights as the naive
    server, unmodified HF code; torch threads as the servers'.
    """

    def __init__(self, budget: int) -> None:
        import torch

        from bench.baseline_server import naive_processor
        from vitserve.model.demo import build_demo_visual

        torch.set_num_threads(threads())
        self.processor = naive_processor(budget)
        self.model = build_demo_visual()

    def __call__(self, jpeg: bytes) -> dict[str, float]:
        import torch
        from PIL import Image

        t0 = time.perf_counter()
        pil = Image.open(io.BytesIO(jpeg)).convert("RGB")
        inputs = self.processor(images=pil, return_tensors="pt")
        with torch.inference_mode():
            t1 = time.perf_counter()
            emb = self.model(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
            t2 = time.perf_counter()
        return {"total": (t2 - t0) * 1e3, "prep": (t1 - t0) * 1e3, "forward": (t2 - t1) * 1e3,
                "num_tokens": float(emb.shape[0])}  # fmt: skip


def raw_post(port: int, path: str, body: bytes) -> tuple[dict[str, float], bytes]:
    """POST with a plain socket; the client-side stamps (seconds since the start) and the response body."""
    t0 = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port))
    t_conn = time.perf_counter()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + body)  # one write, as http.client does for a bytes body: no client-side Nagle
    t_sent = time.perf_counter()
    buf = sock.recv(65536)
    t_first = time.perf_counter()
    while b"\r\n\r\n" not in buf:
        buf += _recv(sock)
    t_head = time.perf_counter()
    header, _, rest = buf.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", header).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        rest += _recv(sock)
    t_body = time.perf_counter()
    sock.close()
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {rest[:300]!r}")
    stamps = {"connect": t_conn - t0, "write": t_sent - t_conn, "first_byte": t_first - t_sent,
              "headers": t_head - t_first, "body_gap": t_body - t_head, "total": t_body - t0}  # fmt: skip
    return stamps, rest


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise RuntimeError("the server closed the connection early")
    return chunk


def stage_sums(port: int) -> dict[str, float]:
    _, text = raw_get(port, "/metrics")
    return {stage: float(v) for stage, v in _STAGE_SUM.findall(text.decode())}


def raw_get(port: int, path: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    return int(header.split(b" ", 2)[1]), body


def one_request(name: str, port: int, body: bytes) -> dict[str, float]:
    """Client stamps, plus the server's own stage times for this request (ms)."""
    before = stage_sums(port) if name != "naive" else {}
    stamps, payload = raw_post(port, "/encode", body)
    row = {k: v * 1e3 for k, v in stamps.items()}
    answer = json.loads(payload)
    if name == "naive":  # bench/baseline_server.py's own timers
        timing = answer["timing_ms"]
        row.update(server=timing["total"], prep=timing["prep"], forward=timing["forward"])
    else:
        after = stage_sums(port)
        row.update({k: (after.get(k, 0.0) - before.get(k, 0.0)) * 1e3 for k in SERVER_STAGES})
    row["num_tokens"] = answer["images"][0]["num_tokens"]
    return row


def run_size(
    ports: dict[str, int], images: list[bytes], rounds: int, inprocess: InProcess | None = None
) -> dict:
    bodies = json_bodies(images)

    def one(name: str, k: int) -> dict[str, float]:
        if name == "inprocess":
            assert inprocess is not None
            row = inprocess(images[k % len(images)])
        else:
            row = one_request(name, ports[name], bodies[k % len(bodies)])
        time.sleep(GAP_S)
        return row

    names = list(ports) + (["inprocess"] if inprocess is not None else [])
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for name in names:  # one unrecorded request each: first-request costs out of the way
        one(name, 0)
    for k in range(rounds):
        for name in harness.rotate(names, k):
            rows[name].append(one(name, k))
    return {"loadavg": list(os.getloadavg()), "summary": summarize(rows),
            "rows": {n: [{k: round(v, 3) for k, v in r.items()} for r in rs] for n, rs in rows.items()}}  # fmt: skip


def derived(name: str, r: dict[str, float]) -> dict[str, float]:
    """Stages computed from the measured ones, per request."""
    if name == "inprocess":
        return {"outside_forward": r["total"] - r["forward"] - r["prep"]}
    if name == "naive":
        return {
            "outside_handler": r["total"] - r["server"],
            "outside_forward": r["total"] - r["forward"] - r["prep"],
        }
    return {
        "pool_hops": r["prepare"] - r["decode"] - r["preprocess"],
        "engine_python": r["engine"] - r["queue"] - r["encode"],
        "zmq_rank_hop": r["encode"] - r["forward"],
        "outside_handler": r["total"] - r["request"],
        "outside_forward": r["total"] - r["forward"] - r["decode"] - r["preprocess"],
    }


def summarize(rows: dict[str, list[dict[str, float]]]) -> dict:
    out: dict[str, dict] = {}
    for name, rs in rows.items():
        full = [{**r, **derived(name, r)} for r in rs]
        out[name] = {
            k: {
                "p50": harness.nearest([r[k] for r in full], 0.5, 3),
                "p90": harness.nearest([r[k] for r in full], 0.9, 3),
            }
            for k in full[0]
        }
    servers = [n for n in rows if n not in ("naive", "inprocess")]
    if "naive" in rows:
        naive_p50 = out["naive"]["total"]["p50"]
        out["p50_vs_naive"] = {n: round(out[n]["total"]["p50"] / naive_p50, 3) for n in rows if n != "naive"}
    if "inprocess" in rows:  # issue 23's two ratios
        base = out["inprocess"]
        out["vs_inprocess"] = {
            n: {"p50": round(out[n]["total"]["p50"] / base["total"]["p50"], 3),
                "encode_vs_forward": round(out[n]["encode"]["p50"] / base["forward"]["p50"], 3)}
            for n in servers
        }  # fmt: skip
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="20 and 2 rounds")
    ap.add_argument("--rounds", type=int, default=150, help="rounds with 224x224 JPEGs")
    ap.add_argument("--large_rounds", type=int, default=20, help="rounds with 640x480 JPEGs (0: skip)")
    ap.add_argument("--budget", type=int, default=BUDGET, help="--visual_batch_max_tokens (default 4096)")
    ap.add_argument("--before", type=Path, help="another checkout of vitserve to run beside this one")
    ap.add_argument("--no_inprocess", action="store_true", help="skip the in-process transformers baseline")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.large_rounds = 20, 2
    run = harness.begin("latency", args)
    sizes = {"224x224": ((224, 224), args.rounds), "640x480": ((640, 480), args.large_rounds)}
    with contextlib.ExitStack() as stack:
        ports = {
            "vitserve": stack.enter_context(launched("vitserve", args.budget, args.out / "lat-vitserve.log"))
        }
        if args.before is not None:
            before = launched("vitserve", args.budget, args.out / "lat-before.log", args.before.resolve())
            ports["before"] = stack.enter_context(before)
        ports["naive"] = stack.enter_context(launched("baseline", args.budget, args.out / "lat-naive.log"))
        inprocess = None if args.no_inprocess else InProcess(args.budget)
        names = [*ports, *(["inprocess"] if inprocess is not None else [])]
        results = {}
        for label, (size, rounds) in sizes.items():
            if rounds <= 0:
                continue
            images = photos(size, 8)
            results[label] = run_size(ports, images, rounds, inprocess)
            s = results[label]["summary"]
            print(f"{label} (load {os.getloadavg()[0]:.1f}): p50 ms "
                  + ", ".join(f"{n} {s[n]['total']['p50']:.1f}" for n in names)
                  + f"; vs naive {s['p50_vs_naive']}; outside forward p50 "
                  + ", ".join(f"{n} {s[n]['outside_forward']['p50']:.2f}" for n in names), flush=True)  # fmt: skip
            for n, r in s.get("vs_inprocess", {}).items():
                print(f"{label} {n} vs in-process transformers: p50 {r['p50']:.3f}x (target <= 1.0), "
                      f"encode / HF forward {r['encode_vs_forward']:.3f}x (target <= 0.95)", flush=True)  # fmt: skip
    harness.finish(run, {"budget": args.budget, "servers": names, "sizes": results}, args)


if __name__ == "__main__":
    main()
