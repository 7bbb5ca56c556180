"""RESULTS.md's tables and the serving plots, from the latest recorded run of each benchmark.

    python bench/report.py            # print each table under its header line (commit, machine, load)
    python bench/report.py --write    # also put them into bench/RESULTS.md, between its report markers

Reads the last line of bench/out/<bench>.jsonl (written by bench/record.py) for each of BENCHES, and redraws
bench/serve_throughput.png and bench/serve_latency_cdf.png from the serve run, so the plots and the tables
always come from the same run. A benchmark that never ran here is reported as such, never filled from an
older file.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402

BENCHES = (
    "encoder",
    "serve",
    "transfer",
    "cache",
    "jpeg_draft",
    "startup",
    "scaling",
    "preprocess",
    "latency",
    "gateway",
    "video_decode",
    "video_fairness",
)
RESULTS = ROOT / "bench" / "RESULTS.md"


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _errors(row: dict) -> int:
    return sum(row.get("errors", {}).values())  # {kind: count}, see bench/loadgen.py


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def encoder_table(res: dict) -> list[str]:
    peak, size = res["meta"]["peak_flops"], res["meta"].get("peak_matmul_size", 4096)
    rows = []
    for r in res["rows"]:
        ips = r["images_per_s"]
        hf_fraction = r["gflop"] * 1e9 / r["seconds"]["hf_packed"] / peak  # HF packed's share of the peak
        rows.append([r["workload"], r["images"], r["patches"], _f(ips["hf_one_at_a_time"]), _f(ips["hf_packed"]),
                     _f(ips["vitserve_packed"]), f"**{_f(r['vs_hf_packed'])}x**", f"{_f(r['vs_hf_one'])}x",
                     f"**{100 * r['peak_fraction']:.0f}%**", f"{100 * hf_fraction:.0f}%",
                     f"{_f(1 / hf_fraction)}x", f"{r['max_abs_diff']:.1e}"])  # fmt: skip
    head = ["workload", "images", "patches", "HF one img/s", "HF packed img/s", "vitserve img/s", "x HF packed",
            "x HF one", "% of matmul peak", "HF packed % of peak", "ceiling x HF packed", "max abs diff"]  # fmt: skip
    return _table(head, rows) + [
        "",
        f"Matmul peak (fp32 torch.mm {size}², same run): {peak / 1e9:.1f} GFLOP/s; "
        f"threads {res['meta']['threads']}, repeats {res['meta']['repeats']}. "
        "Ceiling = the speed-up over HF packed that running every matmul FLOP at the measured peak would give: "
        "no kernel that does the same FLOPs can beat it.",
    ]


def serve_table(res: dict) -> list[str]:
    servers = res["servers"]
    vit, naive = servers.get("vitserve", {}), servers.get("baseline", {})
    rows = []
    for workload in res["workload_params"]:
        base = {r["concurrency"]: r for r in naive.get(workload, [])}
        for v in vit.get(workload, []):
            b = base.get(v["concurrency"], {})
            ratio = v["images_per_s"] / b["images_per_s"] if b.get("images_per_s") else None
            p50 = v["p50_s"] / b["p50_s"] if v.get("p50_s") and b.get("p50_s") else None
            rows.append([workload, v["concurrency"], _f(v["images_per_s"]), _f(b.get("images_per_s")),
                         f"**{_f(ratio)}x**", _f(v["p50_s"]), _f(b.get("p50_s")), _f(p50),
                         _f(v.get("mean_batch_fill_ratio")), _errors(v) + _errors(b),
                         _f(v.get("loadavg"), 1)])  # fmt: skip
    head = ["workload", "clients", "vitserve img/s", "naive img/s", "x naive", "vitserve p50 s", "naive p50 s",
            "p50 / naive", "batch fill", "errors", "load"]  # fmt: skip
    enc = res["encoder_only"]
    ceiling = ", ".join(f"{w} {_f(enc[w]['images_per_s'])}" for w in res["workload_params"] if w in enc)
    return _table(head, rows) + [
        "",
        f"Profile `{res['profile']}`, budget {res['budget']} tokens. Encoder-only "
        f"ceiling (in-process, img/s): {ceiling or '-'}.",
    ]


def transfer_table(rows: list[dict]) -> list[str]:
    body = [[r["dtype"], r["MB"], r["path"], r["malloc"], r["zmq_GBps"], r["clone_GBps"], r["copy_GBps"],
             f"**{r['ratio_vs_clone']}**", r["ratio_vs_copy"]] for r in rows]  # fmt: skip
    head = ["dtype", "MB", "path", "malloc", "ZMQ GB/s", "clone GB/s", "copy_ GB/s", "/ clone", "/ copy_"]
    return _table(head, body)


def cache_table(rows: list[dict]) -> list[str]:
    body = [[r["mode"], r["order"], r["images"], r["encoded"], r["images_per_s"], f"**{r['speedup_vs_off']}x**",
             r.get("hit_ms", "-")] for r in rows]  # fmt: skip
    return _table(["mode", "order", "requests", "encoded", "images/s", "x off", "cache hit ms"], body)


def jpeg_draft_table(res: dict) -> list[str]:
    speed = {r["budget"]: r for r in res["speed"]}
    body = []
    for model, rows in res["fidelity"].items():
        for r in rows:
            s = speed.get(r["budget"]) if model == "demo" else None
            body.append([model, r["budget"], "/".join(str(x) for x in sorted(set(r["draft_scales"]))),
                         f"{r['mean_cosine']:.6f}", f"{r['worst_image_cosine']:.6f}", f"{r['worst_token_cosine']:.6f}",
                         _f(s and s["full_median_s"], 3), _f(s and s["draft_median_s"], 3),
                         f"**{_f(s['speedup_median'])}x**" if s else "-"])  # fmt: skip
    head = ["model", "budget", "draft scale", "mean cosine", "worst image", "worst token", "full s", "draft s",
            "speed-up"]  # fmt: skip
    note = (
        f"{res['photos']} photos of {res['size'][0]}x{res['size'][1]}; decode+preprocess medians (one "
        f"thread) on the demo rows. All cosines >= {res['threshold']}: {res['default_on']} (the flag stays opt-in either way: not exact)."
    )
    return _table(head, body) + ["", note]


def startup_table(res: dict) -> list[str]:
    body = [[s["kind"], f"**{_f(s['ready_s'], 1)}**", "skipped" if s["stress_skipped"] else "ran",
             _f(s["loadavg"][0], 1)] for s in res["starts"]]  # fmt: skip
    targets = "targets: cold <= 30 s, warm <= 5 s"
    return _table(["start", "to /ready s", "stress", "load"], body) + [
        "",
        f"Budget {res['budget']}; {targets}.",
    ]


def scaling_table(res: dict) -> list[str]:
    rows, body = res["rows"], []
    base = rows.get("tp1", {})
    for name, workloads in rows.items():
        for workload, points in workloads.items():
            for i, r in enumerate(points):
                ref = base.get(workload, [None] * (i + 1))[i]
                ratio = r["images_per_s"] / ref["images_per_s"] if ref and ref["images_per_s"] else None
                body.append([name, " ".join(res["configs"][name]) or "-", workload, r["concurrency"],
                             _f(r["images_per_s"]), f"**{_f(ratio)}x**", _f(r["p50_s"]),
                             _f(r["mean_batch_fill_ratio"]), _errors(r), _f(r["loadavg"], 1)])  # fmt: skip
    head = [
        "config",
        "flags",
        "workload",
        "clients",
        "img/s",
        "x tp1",
        "p50 s",
        "batch fill",
        "errors",
        "load",
    ]
    return _table(head, body) + ["", f"Budget {res['budget']}; `--model demo`; same machine, same run."]


def preprocess_table(res: dict) -> list[str]:
    body = []
    for r in res["rows"]:
        ms = {k: r[k] * 1e3 for k in ("decode_s", "hf_s", "fast_s", "fast_resize_s", "fast_norm_s", "hf_resize_s",
                                      "hf_rest_s")}  # fmt: skip
        # the best any normalisation could do: decode and the same PIL resize are left
        ceiling = (r["decode_s"] + r["hf_s"]) / (r["decode_s"] + r["fast_resize_s"])
        body.append([r["input"], r["budget"], r["tokens"], _f(ms["decode_s"], 1), _f(ms["hf_resize_s"], 1),
                     _f(ms["hf_rest_s"], 1), _f(ms["hf_s"], 1), _f(ms["fast_resize_s"], 1),
                     _f(ms["fast_norm_s"], 1), _f(ms["fast_s"], 1), f"**{_f(r['ratio'])}x**",
                     f"{_f(r['pre_ratio'])}x", f"{_f(ceiling)}x", _f(r["draft_ratio"]) + "x" if r["draft_ratio"] else "-",
                     _f(r["loadavg"][0], 1)])  # fmt: skip
    head = ["input", "budget", "tokens", "decode ms", "HF resize", "HF rest", "HF ms", "fast resize", "fast norm",
            "fast ms", "ratio", "pre ratio", "ceiling", "draft ratio", "load"]  # fmt: skip
    lines = _table(head, body)
    cv = res.get("opencv")
    if cv:
        lines += ["", f"OpenCV instead of PIL's resize ({cv['input']}, budget {cv['budget']}; PIL "
                  f"{cv['pil_resize_s'] * 1e3:.1f} ms): " + "; ".join(
                      f"{k} {v['resize_s'] * 1e3:.1f} ms, max uint8 difference {v['max_pixel_diff']}, max embedding "
                      f"difference {v['max_embedding_diff']:.3g}" for k, v in cv.items() if isinstance(v, dict))]  # fmt: skip
    return lines


# bench/latency.py's stages, in the order a request meets them: (key, label); derived ones in italics
LATENCY_STAGES = (("connect", "client: connect"), ("write", "client: request written"),
                  ("read", "server: body read"), ("parse", "server: JSON/base64 parse"),
                  ("prepare", "server: prepare (pool hops + decode + preprocess)"), ("decode", "decode"),
                  ("preprocess", "preprocess"), ("prep", "decode + preprocess (naive)"),
                  ("pool_hops", "_pool hops_"), ("queue", "server: queue"), ("encode", "server: encode (dispatch -> result)"),
                  ("zmq_rank_hop", "_ZMQ hop to rank 0 and back_"),
                  ("forward", "**forward**"), ("engine_python", "_engine bookkeeping (engine - queue - encode)_"),
                  ("respond", "server: response body"), ("request", "server: whole handler"),
                  ("server", "server: whole handler (naive)"),
                  ("outside_handler", "_HTTP in/out + kernel (client total - handler)_"),
                  ("first_byte", "client: written -> first byte"), ("body_gap", "client: headers -> body (Nagle)"),
                  ("total", "**client total**"), ("outside_forward", "**_outside the forward_**"))  # fmt: skip


def latency_table(res: dict) -> list[str]:
    servers = res["servers"]
    lines: list[str] = []
    for size, run in res["sizes"].items():
        s = run["summary"]
        rows = []
        for key, label in LATENCY_STAGES:
            cells = [
                f"{_f(s[n][key]['p50'])} / {_f(s[n][key]['p90'])}" if key in s[n] else "-" for n in servers
            ]
            if any(c != "-" for c in cells):
                rows.append([label, *cells])
        ratios = ", ".join(f"{n} **{r:.3f}x**" for n, r in s["p50_vs_naive"].items())
        n_req = len(run["rows"][servers[0]])
        lines += [
            f"**{size} JPEG**, {n_req} requests per server, load {_f(run['loadavg'][0], 1)} at the end:",
            "",
        ]
        lines += _table(["stage (ms, p50 / p90)", *servers], rows)
        lines += ["", f"p50 / naive p50: {ratios}.", ""]
        if "vs_inprocess" in s:  # issue 23: against plain transformers in the benchmark's process
            inproc = "; ".join(f"{n} p50 **{r['p50']:.3f}x**, encode / HF forward **{r['encode_vs_forward']:.3f}x**"
                               for n, r in s["vs_inprocess"].items())  # fmt: skip
            lines += [
                f"Against in-process transformers (p50 / p50; encode stage / forward, medians): {inproc}.",
                "",
            ]
    lines.append(
        f"Budget {res['budget']}; targets: outside the forward <= 5 ms median, p50 <= 1.0x naive; "
        "against in-process transformers on small images p50 <= 1.0x, encode <= 0.95x its forward."
    )
    return lines


def gateway_table(res: dict) -> list[str]:
    def ratio(base, via) -> str:
        return f"**{via / base:.2f}x**" if base and via else "n/a"

    rows = []
    for p in res["points"]:
        a, b = p["vllm"], p["vitserve"]
        rows.append([p["workload"], p["clients"], f"{_f(a['ttft_p50_s'])} / {_f(a['ttft_p99_s'])}",
                     f"{_f(b['ttft_p50_s'])} / {_f(b['ttft_p99_s'])}", ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
                     ratio(a["ttft_p99_s"], b["ttft_p99_s"]), _f(a["req_per_s"]), _f(b["req_per_s"]),
                     ratio(a["req_per_s"], b["req_per_s"]), f"{a['requests']} / {b['requests']}",
                     _f(p["load_before"], 1)])  # fmt: skip
    head = ["workload", "clients", "vLLM ttft p50 / p99 (s)", "via vitserve ttft p50 / p99 (s)",
            "ttft p50 ratio", "ttft p99 ratio", "vLLM req/s", "via vitserve req/s", "req/s ratio",
            "requests", "load"]  # fmt: skip
    return [*_table(head, rows), "",
            "Ratios are via vitserve / vLLM alone. Targets on CPU: one client's ttft p50 ratio <= 1.1; req/s "
            "ratio at 8 clients >= 0.9 (unique) and >= 1.5 (repeated)."]  # fmt: skip


def gateway_widths_table(res: dict) -> list[str]:
    """bench/gateway.py --widths: per model and image size, each arm's ttft against vLLM alone's in its own
    sitting (wire's and pull's: the vLLM with vitserve's connector, a point of its own; an older record names
    none); p90 / p99 where the rounds reached them; vLLM's own queue and prefill means of the arm's requests and
    pull's mean fetch, where the record has them."""
    rows = []
    for p in res["points"]:
        base = p["vllm"]["ttft_p50_s"]
        for arm in (a for a in ("vllm", "inline", "ec_storage", "wire", "pull") if a in p):
            r = p[arm]
            mode = f"vllm ({p['connector']})" if arm == "vllm" and "connector" in p else arm
            tails = " / ".join(_f(r.get(f"ttft_p{q}_s"), 3) for q in (90, 99))
            rows.append([p["model"], p["size"], mode, f"{r['ttft_p50_s']:.3f}", tails,
                         f"**{r['ttft_p50_s'] / base:.2f}x**" if arm != "vllm" and base else "-",
                         f"{r['upstream_bytes']:,}" if "upstream_bytes" in r else "-",
                         f"{r['handover_ms']:.1f}" if "handover_ms" in r else "-", _inside(r.get("in_vllm_ms")),
                         _f(r.get("fetch_ms"), 1), r["requests"], f"{p['load_before']:.1f}"])  # fmt: skip
    head = ["model (row width)", "image", "mode", "ttft p50 (s)", "p90 / p99 (s)", "/ vLLM alone",
            "upstream bytes per request", "vitserve hand-over (ms)", "in vLLM: queue / prefill (engine-core CPU) (ms)",
            "pull's fetch (ms)", "requests", "load"]  # fmt: skip
    return _table(head, rows)


def _inside(times: dict | None) -> str:
    """vLLM's queue / prefill means (ms), and its engine core's CPU ms per request where recorded (its busy-wait on
    the worker: bench/gateway.py --gap_s)."""
    if not times:
        return "-"
    core = f" (core {times['cpu_engine_core']:.0f})" if "cpu_engine_core" in times else ""
    return f"{times['queue_s']:.0f} / {times['prefill_s']:.0f}{core}"


def video_decode_table(res: dict) -> list[str]:
    modes = ("hf", "vitserve", "vitserve_full", "vitserve_pool")
    rows = []
    for r in res["rows"]:
        wall, cpu = r["wall_s"], r["cpu_s"]
        rows.append([r["gop"], r["repeats"], *(f"{_f(wall[m]['median'])} / {_f(cpu[m])}" for m in modes),
                     f"**{_f(r['vs_hf']['vitserve'])}x**", f"{_f(r['vs_hf']['vitserve_full'])}x",
                     f"{_f(r['vs_hf']['vitserve_pool'])}x", f"{_f(cpu['hf'] / cpu['vitserve'])}x"])  # fmt: skip
    head = ["GOP", "repeats", *(f"{m} wall / CPU s" for m in modes), "vitserve x hf", "full x hf", "pool x hf",
            "CPU: hf / vitserve"]  # fmt: skip
    r0 = res["rows"][0]
    return [*_table(head, rows), "",
            f"{res['clip']}, {len(r0['indices'])} frames sampled ({r0['indices'][:3]}...), resized to "
            f"{r0['resized_size'][0]}x{r0['resized_size'][1]}. Wall: median; CPU: median seconds of the decoding "
            "process. Target: vitserve >= 1.5x hf."]  # fmt: skip


def video_fairness_table(res: dict) -> list[str]:
    s, rows = res["summary"], []
    for kind in ("alone", "videos"):
        k, ms = s[kind], s[kind]["ms"]
        rows.append([kind, k["requests"], _f(k["images_per_s"]), *(f"{_f(ms[p]['p50'], 1)} / {_f(ms[p]['p99'], 1)}"
                     for p in ("total", "queue", "decode_preprocess", "encode", "rest")),
                     _f(k["mean_batch_fill"], 3), _f(k["mean_batch_items"]), _f(k["server_cores_busy"]),
                     k["videos_done"], _f(k["video_s_p50"], 1), sum(k["errors"].values())])  # fmt: skip
    head = ["phase", "images", "img/s", "image ms p50 / p99", "queue", "decode + prep", "encode", "rest",
            "batch fill", "items / batch", "server cores", "videos", "video s p50", "errors"]  # fmt: skip
    v = res["video"]
    return [*_table(head, rows), "",
            f"p99 with videos / alone: **{_f(s.get('p99_ratio'))}x** (target <= 1.5); p50: {_f(s.get('p50_ratio'))}x. "
            f"Videos: {v['seconds']} s of {v['size'][0]}x{v['size'][1]} at {v['fps']} fps, GOP {v['gop']}."]  # fmt: skip


TABLES = {"encoder": encoder_table, "serve": serve_table, "transfer": transfer_table, "cache": cache_table,
          "jpeg_draft": jpeg_draft_table, "startup": startup_table, "scaling": scaling_table,
          "preprocess": preprocess_table, "latency": latency_table, "gateway": gateway_table,
          "video_decode": video_decode_table, "video_fairness": video_fairness_table}  # fmt: skip


def section(bench: str, out_dir: Path | None) -> str:
    """Header line (commit, machine, load) and table of `bench`'s latest run."""
    run = record.latest(bench, out_dir)
    if run is None:
        return f"_No `{bench}` run recorded on this machine: run `bench/run_all.sh`._"
    return "\n".join([record.header(run), "", *TABLES[bench](run["results"])])


def write_into(text: str, bench: str, body: str) -> str:
    """Replace what lies between `<!-- report:BENCH -->` and `<!-- /report:BENCH -->`."""
    pattern = re.compile(rf"(<!-- report:{bench} -->\n).*?(<!-- /report:{bench} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{RESULTS} has no <!-- report:{bench} --> ... <!-- /report:{bench} --> markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def draw_serve_plots(out_dir: Path | None, dest: Path) -> list[Path]:
    run = record.latest("serve", out_dir)
    if run is None or not run["results"]["servers"]:
        return []
    from bench import plot

    note = f"commit {run['commit']}{'+' if run['dirty'] else ''}, {run['started']}"
    paths = [dest / "serve_throughput.png", dest / "serve_latency_cdf.png"]
    plot.plot_throughput(run["results"], paths[0], note)
    plot.plot_latency_cdf(run["results"], paths[1], note)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="also fill the tables into bench/RESULTS.md")
    ap.add_argument(
        "--records", type=Path, default=None, help="where the run records are (default bench/out)"
    )
    ap.add_argument("--plots", type=Path, default=ROOT / "bench", help="where the PNGs go")
    args = ap.parse_args(argv)
    sections = {bench: section(bench, args.records) for bench in BENCHES}
    for bench, body in sections.items():
        print(f"## {bench}\n\n{body}\n")
    for path in draw_serve_plots(args.records, args.plots):
        print(f"wrote {path}")
    if (
        args.write
    ):  # a benchmark with no run recorded here keeps the table RESULTS.md has (bench/out is local)
        text = RESULTS.read_text()
        for bench, body in sections.items():
            if record.latest(bench, args.records) is not None:
                text = write_into(text, bench, body)
        RESULTS.write_text(text)
        print(f"filled {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
