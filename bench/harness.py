"""What every benchmark in bench/ shares: its arguments, its sittings and its run record.

    ap = harness.parser(__doc__, quick="1 repeat")     # description, --quick, --out (bench/out)
    args = ap.parse_args()
    run = harness.begin("encoder", args)              # commit, machine, load before (bench/record.py)
    for i, arm_set in enumerate(points):
        with harness.sitting(point=i) as point:       # load average before and after this point
            for arm in harness.alternate(arms, i):    # the compared arms in alternating order
                point[arm] = ...
    harness.finish(run, results, args)               # load after; bench/out/<name>.jsonl; the RESULTS.md header

The workloads (image sizes and mixes) are bench/workloads.py's; the tables are bench/report.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from bench import record

ROOT = record.ROOT
T = TypeVar("T")


def parser(doc: str | None, quick: str | None = None, out: bool = True) -> argparse.ArgumentParser:
    """An argument parser described by the docstring's first line, with the arguments every benchmark takes:
    `--quick` (a smoke run; its help says what it shrinks) and `--out` (where the records and logs go)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    if out:
        ap.add_argument("--out", type=Path, default=record.OUT, help="where the run record goes (bench/out)")
    return ap


def begin(bench: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start the record of a run (commit, machine, load average before, arguments). A SIGTERM from here on
    unwinds through the benchmark's finally blocks, so the servers it started stop."""
    record.unwind_on_sigterm()
    out = getattr(args, "out", None)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    return record.begin(bench, args)


def finish(run: dict[str, Any], results: Any, args: argparse.Namespace | None = None) -> Path:
    """Append the record (load average after, wall time, results) and print RESULTS.md's header line for it."""
    path = record.finish(run, results, getattr(args, "out", None))
    print(record.header(record.latest(run["bench"], path.parent) or {}))
    return path


def load() -> float:
    """The 1-minute load average: what each point records beside its numbers."""
    return os.getloadavg()[0]


@contextmanager
def sitting(**fields: Any) -> Iterator[dict[str, Any]]:
    """One point of a comparison: `fields` plus the load average before and after it."""
    point: dict[str, Any] = {**fields, "load_before": load()}
    yield point
    point["load_after"] = load()


def alternate(arms: Sequence[T], i: int) -> list[T]:
    """The arms in order on even points and reversed on odd ones, so each goes first as often as the other
    and a change of background load does not favour one."""
    return list(arms) if i % 2 == 0 else list(reversed(arms))


def rotate(arms: Sequence[T], i: int) -> list[T]:
    """The arms rotated by `i`: with more than two, each goes first in turn (with two, as `alternate`)."""
    shift = i % len(arms)
    return [*arms[shift:], *arms[:shift]]


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_median(times: Sequence[float]) -> tuple[float, float]:
    """(best, median): the best is the least disturbed by a shared machine, the median the typical."""
    return min(times), statistics.median(times)


def nearest(xs: Sequence[float], q: float, digits: int | None = None) -> float | None:
    """The nearest-rank `q` quantile (0..1), rounded to `digits` if given; None for no samples."""
    if not xs:
        return None
    x = sorted(xs)[min(len(xs) - 1, round(q * (len(xs) - 1)))]
    return x if digits is None else round(x, digits)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_stats() -> dict[int, list[str]]:
    """Each live process's /proc/<pid>/stat fields after its name (index 1: the parent's id)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stats[int(entry)] = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
    return stats


def process_tree(root: int, stats: dict[int, list[str]] | None = None) -> list[int]:
    """`root` and every live descendant (a server's ranks and decoders), from /proc's parent ids."""
    parents = {pid: int(fields[1]) for pid, fields in (stats or _proc_stats()).items()}
    out, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        out += frontier
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a process and all its live descendants."""
    stats, ticks = _proc_stats(), os.sysconf("SC_CLK_TCK")
    return sum(
        (int(stats[p][11]) + int(stats[p][12])) / ticks for p in process_tree(root, stats) if p in stats
    )


def pct(xs: Sequence[float], q: int) -> float | None:
    """The q-th percentile (inclusive method), rounded to 0.1 ms; None for no samples."""
    if not xs:
        return None
    if len(xs) == 1:
        return round(xs[0], 4)
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4)
