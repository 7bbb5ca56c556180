"""PNG plots of one bench/serve.py run: throughput vs concurrency, and latency CDFs.

bench/report.py calls these with the latest recorded serve run and writes bench/serve_throughput.png and
bench/serve_latency_cdf.png (small files, committed with RESULTS.md); `note` (the run's commit and time)
goes into each title so a plot can be matched to its table.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the bench machines
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"vitserve": "tab:blue", "baseline": "tab:orange"}


def plot_throughput(report: dict, path: Path, note: str = "") -> None:
    workloads = list(report["workload_params"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for kind, rows in report["servers"].items():
            conc = [r["concurrency"] for r in rows[workload]]
            ips = [r["images_per_s"] for r in rows[workload]]
            ax.plot(conc, ips, "o-", color=COLOURS.get(kind), label=kind)
        keys = ["encoder_only"] + (
            [] if report["encoder_only"].get("fast_kernels") else ["encoder_only_fast"]
        )
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
    fig.suptitle(
        f"Throughput vs concurrency (demo model, budget {report['budget']} tokens) {note}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_latency_cdf(report: dict, path: Path, note: str = "") -> None:
    workloads = list(report["workload_params"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for kind, rows in report["servers"].items():
            row = rows[workload][-1]  # highest concurrency: the saturated point
            xs = sorted(row["latencies_s"])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(
                xs,
                ys,
                where="post",
                color=COLOURS.get(kind),
                label=f"{kind} (c={row['concurrency']}, n={len(xs)})",
            )
        ax.set_xlabel("request latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(workload)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Latency CDF at the highest concurrency {note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
