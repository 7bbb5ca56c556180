"""How one machine's cores are best split: one group (--tp 1), data parallel (--dp N) or tensor parallel (--tp N).

    python bench/scaling.py                 # tp1, dp2, tp2; small and mixed; 8 clients; 10 s points
    python bench/scaling.py --quick         # 5 s points
    python bench/report.py                  # RESULTS.md's scaling table from the latest run

Starts one real `vitserve --model demo` per configuration (bench/serve.py's launcher, each on its own free
port), all at once, and runs every point on each of them back to back, rotating which goes first, so that
they see the same background load. Each configuration gets the same cores: vitserve gives each rank
cpu_count // (tp*dp) torch threads. Figures are ratios against `tp1` in the same run; docs/scaling.md cites
them. Records to bench/out/scaling.jsonl (bench/harness.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.loadgen import json_bodies  # noqa: E402
from bench.serve import launched, measure_point  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

CONFIGS: dict[str, tuple[str, ...]] = {"tp1": (), "dp2": ("--dp", "2"), "tp2": ("--tp", "2")}
IMAGES = {"small": 16, "mixed": 4}
CAP = {"small": 400, "mixed": 20}  # request cap per point


def measure(args: argparse.Namespace) -> dict:
    bodies = {w: json_bodies(WORKLOADS[w](IMAGES[w])) for w in args.workloads.split(",")}
    names = args.configs.split(",")
    rows: dict = {name: {w: [] for w in bodies} for name in names}
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                launched("vitserve", args.budget, 0, args.out / f"scaling-{name}.log", CONFIGS[name])
            )
            for name in names
        }
        turn = 0
        for workload, blobs in bodies.items():
            for name in names:  # warm-up, unmeasured
                measure_point(name, urls[name], workload, blobs, 1, args.seconds, 2)
            for clients in args.clients:
                for name in harness.rotate(names, turn):
                    row = measure_point(
                        name, urls[name], workload, blobs, clients, args.seconds, CAP[workload]
                    )
                    rows[name][workload].append(row)
                turn += 1
    return {"budget": args.budget, "configs": {n: list(CONFIGS[n]) for n in names}, "rows": rows}


def main() -> None:
    ap = harness.parser(__doc__, quick="5 s points")
    ap.add_argument("--budget", type=int, default=1024, help="--visual_batch_max_tokens")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--workloads", default="small,mixed")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    args.seconds = 5 if args.quick else 10
    run = harness.begin("scaling", args)
    result = measure(args)
    print(
        json.dumps(
            {
                n: {w: [r["images_per_s"] for r in rs] for w, rs in d.items()}
                for n, d in result["rows"].items()
            }
        )
    )
    harness.finish(run, result, args)


if __name__ == "__main__":
    main()
