"""One JSON line per benchmark run: which code, which machine, how loaded, what was asked, what came out.

Every script in bench/ brackets its measurement with this module:

    run = record.begin("encoder", args)     # commit, machine, load average before, arguments
    ...measure...
    record.finish(run, results)             # load average after, wall time; appends to bench/out/encoder.jsonl

bench/report.py reads the last line of each file (`latest`) to draw the plots and print RESULTS.md's tables,
so every published number can be traced to the commit and the load it was measured at.
bench/out/ is git-ignored: the records stay on the machine that ran them.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"


def git_state() -> dict[str, Any]:
    """Short commit of HEAD and whether tracked files differ from it (a dirty tree is not that commit)."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()  # fmt: skip

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": cpu_model(), "nproc": os.cpu_count(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version()}  # fmt: skip


def unwind_on_sigterm() -> None:
    """A SIGTERM (`timeout`, a killed sitting) exits through the normal unwinding, code 143, so the finally
    blocks and context managers of a benchmark stop the servers it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def begin(bench: str, args: Any) -> dict[str, Any]:
    """Start a run's record: `args` is the argparse Namespace (or a dict) the benchmark ran with."""
    arguments = vars(args) if hasattr(args, "__dict__") else dict(args)
    return {
        "bench": bench,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_state(),
        "machine": machine(),
        "argv": sys.argv[1:],
        "args": {k: _plain(v) for k, v in arguments.items()},
        "loadavg_before": list(os.getloadavg()),
        "_t0": time.monotonic(),
    }


def finish(run: dict[str, Any], results: Any, out_dir: Path | None = None) -> Path:
    """Append the finished record to <out_dir>/<bench>.jsonl (default bench/out/) and return that path."""
    record = {k: v for k, v in run.items() if k != "_t0"}
    record["loadavg_after"] = list(os.getloadavg())
    record["seconds"] = round(time.monotonic() - run["_t0"], 1)
    record["results"] = results
    out = Path(out_dir) if out_dir is not None else OUT
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{run['bench']}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(record, default=_plain) + "\n")
    print(
        f"recorded {run['bench']} run of {record['commit']}{' (dirty)' if record['dirty'] else ''} in {path}"
    )
    return path


def latest(bench: str, out_dir: Path | None = None) -> dict[str, Any] | None:
    """The last record of `bench`, or None if it never ran here."""
    path = (Path(out_dir) if out_dir is not None else OUT) / f"{bench}.jsonl"
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def header(record: dict[str, Any]) -> str:
    """The line above each RESULTS.md table: commit, when, machine, load, versions, arguments."""
    m = record["machine"]
    dirty = " + uncommitted changes" if record.get("dirty") else ""
    before, after = record["loadavg_before"][0], record["loadavg_after"][0]
    gpu = f", {m['gpu']}" if m.get("gpu") else ", no GPU"
    argv = " ".join(record["argv"]) or "(defaults)"
    return (f"Commit `{record['commit']}`{dirty}, {record['started']}, {record['seconds']:.0f} s; "
            f"{m['cpu']} x {m['nproc']}{gpu}; load average {before:.1f} before, {after:.1f} after; "
            f"torch {m['torch']}, Python {m['python']}; arguments: `{argv}`.")  # fmt: skip


def _plain(value: Any) -> Any:
    """JSON-friendly: paths and other objects as their str."""
    if isinstance(value, (str, int, float, bool, type(None), list, dict)):
        return value
    if isinstance(value, tuple):
        return list(value)
    return str(value)
