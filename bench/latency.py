"""One client, sequential requests: where a request's time goes in vitserve, against the naive loop.

    python bench/latency.py                          # 224-px JPEGs (150 rounds) and 640x480 (20 rounds)
    python bench/latency.py --quick                  # a smoke run (20 and 2 rounds)
    python bench/latency.py --before /tmp/old        # also an older vitserve tree, interleaved

Starts `vitserve --model demo --visual_batch_max_tokens 4096` (the real CLI) and bench/baseline_server.py
at the same budget (same seeded weights), and with --before a second vitserve run from another tree (e.g.
`git archive <commit> | tar -x -C /tmp/old`; its own code on PYTHONPATH), so a change is measured before
and after in one sitting. Each round sends one request to each server in turn, rotating which goes first,
so every server sees the same background load. Stages per request, median and p90 in ms:

- client side, a raw socket (no HTTP library): connect, request written, first response byte, headers,
  body complete. The headers -> body gap is where a Nagle stall would show (~40 ms): a server-side timer
  cannot see it;
- server side, vitserve's own vitserve_stage_seconds: /metrics is scraped before and after every request,
  and with one request at a time the increase of a stage's _sum is that request's time
  (vitserve/api/encode.py; `forward` is rank 0's own timer); the naive server's own timing_ms;
- derived: pool hops = prepare - decode - preprocess; ZMQ + rank hop = encode (dispatch -> result) -
  forward; outside the handler = client total - request (HTTP parse, middleware, response write, kernel);
  outside the forward = client total - forward - decode - preprocess (target <= 5 ms median).

The record (bench/record.py) goes to bench/out/latency.jsonl; bench/report.py prints its table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what the CLI gives its ranks (vitserve/cli.py)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.loadgen import json_bodies  # noqa: E402
from bench.serve import launched as serve_launched  # noqa: E402
from bench.workloads import jpeg_bytes, photo_like  # noqa: E402

BUDGET = 4096
SERVER_STAGES = ("read", "parse", "prepare", "decode", "preprocess", "engine", "queue", "encode", "forward",
                 "respond", "request")  # fmt: skip
_STAGE_SUM = re.compile(r'^vitserve_stage_seconds_sum\{stage="(\w+)"\}\s+(\S+)$', re.MULTILINE)


@contextlib.contextmanager
def launched(kind: str, budget: int, log_path: Path, tree: Path = ROOT) -> Iterator[int]:
    """One server as a subprocess, its code from `tree` (this checkout unless --before); yields its port."""
    with serve_launched(kind, budget, max(1, os.cpu_count() or 1), log_path, tree=tree) as url:
        yield int(url.rsplit(":", 1)[1])


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


def run_size(ports: dict[str, int], images: list[bytes], rounds: int) -> dict:
    bodies = json_bodies(images)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in ports}
    names = list(ports)
    for name in names:  # one unrecorded request each: first-request costs out of the way
        one_request(name, ports[name], bodies[0])
    for k in range(rounds):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            rows[name].append(one_request(name, ports[name], bodies[k % len(bodies)]))
    return {"loadavg": list(os.getloadavg()), "summary": summarize(rows),
            "rows": {n: [{k: round(v, 3) for k, v in r.items()} for r in rs] for n, rs in rows.items()}}  # fmt: skip


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 3)


def derived(name: str, r: dict[str, float]) -> dict[str, float]:
    """Stages computed from the measured ones, per request."""
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
            k: {"p50": _q([r[k] for r in full], 0.5), "p90": _q([r[k] for r in full], 0.9)} for k in full[0]
        }
    naive_p50 = out["naive"]["total"]["p50"]
    out["p50_vs_naive"] = {n: round(out[n]["total"]["p50"] / naive_p50, 3) for n in rows if n != "naive"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=150, help="rounds with 224x224 JPEGs")
    ap.add_argument("--large_rounds", type=int, default=20, help="rounds with 640x480 JPEGs (0: skip)")
    ap.add_argument("--budget", type=int, default=BUDGET, help="--visual_batch_max_tokens (default 4096)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 and 2 rounds")
    ap.add_argument("--before", type=Path, help="another checkout of vitserve to run beside this one")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.large_rounds = 20, 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are stopped
    args.out.mkdir(parents=True, exist_ok=True)
    run = record.begin("latency", args)
    sizes = {"224x224": ((224, 224), args.rounds), "640x480": ((640, 480), args.large_rounds)}
    with contextlib.ExitStack() as stack:
        ports = {
            "vitserve": stack.enter_context(launched("vitserve", args.budget, args.out / "lat-vitserve.log"))
        }
        if args.before is not None:
            before = launched("vitserve", args.budget, args.out / "lat-before.log", args.before.resolve())
            ports["before"] = stack.enter_context(before)
        ports["naive"] = stack.enter_context(launched("baseline", args.budget, args.out / "lat-naive.log"))
        results = {}
        for label, ((w, h), rounds) in sizes.items():
            if rounds <= 0:
                continue
            images = [jpeg_bytes(photo_like(w, h, seed)) for seed in range(8)]
            results[label] = run_size(ports, images, rounds)
            s = results[label]["summary"]
            print(f"{label}: p50 ms " + ", ".join(f"{n} {s[n]['total']['p50']:.1f}" for n in ports)
                  + f"; vs naive {s['p50_vs_naive']}; outside forward p50 "
                  + ", ".join(f"{n} {s[n]['outside_forward']['p50']:.2f}" for n in ports), flush=True)  # fmt: skip
    record.finish(run, {"budget": args.budget, "servers": list(ports), "sizes": results}, args.out)


if __name__ == "__main__":
    main()
