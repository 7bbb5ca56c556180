"""PNG plots from bench/serve.py's JSON: throughput vs concurrency, and latency CDFs.

    python bench/plot.py [bench/out/serve-latest.json] [--out bench]

Writes <out>/serve_throughput.png and <out>/serve_latency_cdf.png (small files, committed with RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the bench machines
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COLOURS = {"vitserve": "tab:blue", "baseline": "tab:orange"}


def plot_throughput(report: dict, path: Path) -> None:
    workloads = list(report["workload_params"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for kind, rows in report["servers"].items():
            conc = [r["concurrency"] for r in rows[workload]]
            ips = [r["images_per_s"] for r in rows[workload]]
            ax.plot(conc, ips, "o-", color=COLOURS.get(kind), label=kind)
        keys = ["encoder_only"] + ([] if report["encoder_only"].get("fast_kernels") else ["encoder_only_fast"])
        for key, style in zip(keys, ("--", ":"), strict=False):
            enc = report.get(key, {}).get(workload)
            if enc:
                label = "encoder only" + (" (fast kernels)" if report[key].get("fast_kernels") else " (HF)")
                ax.axhline(enc["images_per_s"], color="grey", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] for rows in report["servers"].values() for r in rows[workload]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("images / s")
        ax.set_title(f"{workload}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Throughput vs concurrency (demo model, CPU, budget {report['budget']} tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_latency_cdf(report: dict, path: Path) -> None:
    workloads = list(report["workload_params"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for kind, rows in report["servers"].items():
            row = rows[workload][-1]  # highest concurrency: the saturated point
            xs = sorted(row["latencies_s"])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=COLOURS.get(kind),
                    label=f"{kind} (c={row['concurrency']}, n={len(xs)})")
        ax.set_xlabel("request latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(workload)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Latency CDF at the highest concurrency", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(report: dict) -> str:
    """The Serving tables of bench/RESULTS.md."""
    lines = ["| workload | server | clients | images/s | p50 s | p99 s | mean batch fill | mean images/batch | ok | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload in report["workload_params"]:
        for kind, rows in report["servers"].items():
            for r in rows[workload]:
                lines.append(f"| {workload} | {kind} | {r['concurrency']} | {_f(r['images_per_s'], 3)} | {_f(r['p50_s'])} "
                             f"| {_f(r['p99_s'])} | {_f(r.get('mean_batch_fill_ratio'))} "
                             f"| {_f(r.get('mean_batch_images'), 1)} | {r['images_ok']} | {r['errors'] or ''} |")
    lines += ["", "| workload | vitserve best img/s | baseline best img/s | speed-up | encoder-only img/s "
              "| e2e / encoder-only | fill at highest concurrency |", "|---|---|---|---|---|---|---|"]
    for workload, s in report["summary"].items():
        lines.append(f"| {workload} | {_f(s['vitserve_best_images_per_s'], 3)} | {_f(s['baseline_best_images_per_s'], 3)} "
                     f"| {_f(s['speedup'])}x | {_f(s['encoder_only_images_per_s'], 3)} | {_f(s['e2e_over_encoder_only'])} "
                     f"| {_f(s['fill_at_saturation'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", nargs="?", type=Path, default=ROOT / "bench" / "out" / "serve-latest.json")
    ap.add_argument("--out", type=Path, default=ROOT / "bench")
    ap.add_argument("--markdown", action="store_true", help="also print the RESULTS.md tables")
    args = ap.parse_args()
    report = json.loads(args.report.read_text())
    if args.markdown:
        print(markdown_tables(report))
    plot_throughput(report, args.out / "serve_throughput.png")
    plot_latency_cdf(report, args.out / "serve_latency_cdf.png")
    print(f"wrote {args.out / 'serve_throughput.png'} and {args.out / 'serve_latency_cdf.png'}")


if __name__ == "__main__":
    main()
