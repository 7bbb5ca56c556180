"""The connector store's cost per arrival against the entries it holds (issue 48: flat from 1k to 200k).

    python bench/connector_store.py            # 1k, 10k, 100k, 200k entries held; 300 arrivals each
    python bench/connector_store.py --quick    # 1k and 10k, 50 arrivals each

Per point, the store (vitserve.connector.store.EmbeddingStore, directory on --dir, default /dev/shm) is filled to N
spent entries (loaded by their requests) whose bytes fill the bound exactly, so that every arrival evicts one: the
steady state of a busy connector. Filled through its bookkeeping (no files: an eviction's unlink of a missing file
costs what a real one does, within a few microseconds), then measured per arrival:
- keep: the receiver's whole step for one 12-row message (checks, room made by evicting one spent entry, the raw
  file written and renamed, bookkeeping) plus its expiry sweep, called on the receiver's own code without ZMQ;
- round trip: the same over ZMQ on loopback, from a DEALER's send to the acknowledgement;
- counters: `counters()` (the glue reads it for vLLM's /metrics);
- before: the store as of commit 1265d0b (before issue 48: a scan of every entry per arrival and per poll),
  its `_keep` + `_expire` at the same N, filled the same way (fewer arrivals: each costs O(N)).
Best and median in microseconds; the record goes to bench/out/connector_store.jsonl.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import zmq  # noqa: E402

from bench import harness  # noqa: E402
from vitserve.connector.ledger import HeldTensor  # noqa: E402
from vitserve.connector.store import EmbeddingStore, Shape  # noqa: E402
from vitserve.rpc.replies import decode_reply  # noqa: E402
from vitserve.rpc.wire import ImageEmbedding, decode_embedding_message, encode_embedding_message  # noqa: E402

WIDTH, ROWS, GRID = 24, 12, (1, 6, 8)  # a small item: the bookkeeping, not the copy, is what grows with N
NBYTES = ROWS * WIDTH * 4
BEFORE = "1265d0b"  # the store before issue 48


def message(i: int) -> list:
    parts = [torch.randn(ROWS, 8) for _ in range(3)]
    m = ImageEmbedding(
        "r", 0, 1, "0" * 64, GRID, parts[0], parts[1:], expires_at=time.time() + 600, uuid=f"new-{i}"
    )
    return [bytes(f) for f in encode_embedding_message(m)]


def fill_new(store: EmbeddingStore, n: int) -> None:
    now, ledger = time.time(), store._ledger
    for i in range(n):
        ledger.add(
            f"old-{i}",
            HeldTensor(store.dir / f"old-{i}", "float32", ROWS, WIDTH, NBYTES, now + 600),
            "r",
            now,
        )
        ledger.release(f"old-{i}", "r", now)  # spent: evictable


def measure_new(n: int, arrivals: int, root: Path) -> dict[str, float]:
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", n * NBYTES, Shape(WIDTH, 2), directory=str(root))
    ) as s:
        fill_new(s, n)
        messages = [decode_embedding_message(message(i)) for i in range(arrivals)]
        keep = harness.timed(lambda: (s._keep(messages.pop()), s._sweep()), arrivals)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(s.endpoint)
        frames = [message(arrivals + i) for i in range(arrivals)]

        def round_trip() -> None:
            sock.send_multipart(frames.pop())
            decode_reply(sock.recv())

        trips = harness.timed(round_trip, arrivals)
        counters = harness.timed(s.counters, arrivals)
        sock.close(0)
        held = s.counters()
    if (held["held"], held["evicted"]) != (n, 2 * arrivals):
        raise RuntimeError(f"not the steady state this bench measures: {held}")
    return {**_us("keep", keep), **_us("round_trip", trips), **_us("counters", counters)}


def measure_before(n: int, arrivals: int, root: Path) -> dict[str, float]:
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:vitserve/connector/store.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = root / "store_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("store_before", path)
    assert spec is not None
    assert spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules["store_before"] = old  # dataclasses look their module up there
    spec.loader.exec_module(old)
    with contextlib.closing(
        old.EmbeddingStore("tcp://127.0.0.1:*", n * NBYTES, old.Shape(WIDTH, 2), directory=str(root))
    ) as s:
        now = time.time()
        for i in range(n):
            s.entries[f"old-{i}"] = old.HeldTensor(
                s.dir / f"old-{i}", "float32", ROWS, WIDTH, NBYTES, now + 600, loaded=True
            )
        messages = [decode_embedding_message(message(i)) for i in range(arrivals)]
        keep = harness.timed(lambda: (s._keep(messages.pop()), s._expire(time.time())), arrivals)
        counters = harness.timed(s.counters, max(3, arrivals // 4))
    return {**_us("before_keep", keep), **_us("before_counters", counters)}


def _us(name: str, times: list[float]) -> dict[str, float]:
    best, median = harness.best_median(times)
    return {f"{name}_best_us": round(best * 1e6, 1), f"{name}_median_us": round(median * 1e6, 1)}


def main() -> None:
    ap = harness.parser(__doc__, quick="1k and 10k entries, 50 arrivals each")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the store's directory goes")
    args = ap.parse_args()
    run = harness.begin("connector_store", args)
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000, 200_000]
    arrivals = 50 if args.quick else 300
    points = []
    for n in sizes:
        with harness.sitting(held=n) as point, tempfile.TemporaryDirectory(dir=args.dir) as root:
            point.update(measure_new(n, arrivals, Path(root)))
            point.update(measure_before(n, max(5, min(arrivals, 3_000_000 // n)), Path(root)))
        points.append(point)
        print(point, flush=True)
    harness.finish(run, points, args)
    print(
        "| entries held | keep (us) | round trip (us) | counters() (us) | before: keep (us) | before: counters() (us) | load |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in points:
        print(
            f"| {p['held']:,} | **{p['keep_best_us']:.0f}** ({p['keep_median_us']:.0f}) "
            f"| {p['round_trip_best_us']:.0f} ({p['round_trip_median_us']:.0f}) "
            f"| {p['counters_best_us']:.1f} ({p['counters_median_us']:.1f}) "
            f"| {p['before_keep_best_us']:,.0f} ({p['before_keep_median_us']:,.0f}) "
            f"| {p['before_counters_best_us']:,.0f} ({p['before_counters_median_us']:,.0f}) "
            f"| {p['load_before']:.1f}-{p['load_after']:.1f} |"
        )


if __name__ == "__main__":
    main()
