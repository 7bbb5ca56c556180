"""bench/record.py's run records and bench/report.py's use of them (no benchmark is run)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from bench import record, report

ROOT = Path(__file__).resolve().parents[2]
ROW = {"dtype": "float32", "MB": 58.7, "path": "ipc", "malloc": "glibc", "zmq_GBps": 3.1, "clone_GBps": 4.2,
       "copy_GBps": 9.0, "ratio_vs_clone": 0.74, "ratio_vs_copy": 0.34}  # fmt: skip


def test_record_holds_commit_machine_load_args_and_results(tmp_path):
    run = record.begin("transfer", argparse.Namespace(messages=3, out=tmp_path))
    path = record.finish(run, [ROW], tmp_path)
    (line,) = path.read_text().splitlines()
    rec = json.loads(line)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert rec["commit"] == head
    assert isinstance(rec["dirty"], bool)
    assert rec["machine"]["nproc"] >= 1
    assert rec["machine"]["cpu"]
    assert len(rec["loadavg_before"]) == len(rec["loadavg_after"]) == 3
    assert rec["args"] == {"messages": 3, "out": str(tmp_path)}
    assert rec["results"] == [ROW]
    assert "_t0" not in rec


def test_latest_is_the_last_run_and_none_before_any(tmp_path):
    assert record.latest("cache", tmp_path) is None
    for n in (1, 2):
        record.finish(record.begin("cache", {"n": n}), [], tmp_path)
    assert record.latest("cache", tmp_path)["args"] == {"n": 2}


def test_report_section_names_the_run_and_tabulates_it(tmp_path):
    run = record.begin("transfer", {})
    record.finish(run, [ROW], tmp_path)
    text = report.section("transfer", tmp_path)
    assert f"Commit `{run['commit']}`" in text
    assert "load average" in text
    assert "| float32 | 58.7 | ipc | glibc | 3.1 | 4.2 | 9.0 | **0.74** | 0.34 |" in text
    assert "No `encoder` run recorded" in report.section("encoder", tmp_path)


def test_write_into_replaces_only_between_the_markers():
    text = "intro\n<!-- report:cache -->\nold table\n<!-- /report:cache -->\noutro\n"
    assert (
        report.write_into(text, "cache", "new")
        == "intro\n<!-- report:cache -->\nnew\n<!-- /report:cache -->\noutro\n"
    )
    with pytest.raises(SystemExit, match="report:serve"):
        report.write_into(text, "serve", "new")


def test_write_keeps_the_tables_of_benchmarks_with_no_run_recorded_here(tmp_path, monkeypatch):
    """A fresh clone has no bench/out: --write after one benchmark must not blank the others' tables."""
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "<!-- report:encoder -->\nkept\n<!-- /report:encoder -->\n"
        + "".join(
            f"<!-- report:{b} -->\nold\n<!-- /report:{b} -->\n" for b in report.BENCHES if b != "encoder"
        )
    )
    monkeypatch.setattr(report, "RESULTS", results)
    run = record.begin("transfer", {})
    record.finish(run, [ROW], tmp_path / "out")
    assert report.main(["--write", "--records", str(tmp_path / "out"), "--plots", str(tmp_path)]) == 0
    text = results.read_text()
    assert "<!-- report:encoder -->\nkept\n" in text
    assert f"Commit `{run['commit']}`" in text.split("<!-- report:transfer -->")[1]


def test_results_md_has_a_marker_pair_for_every_benchmark():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    for bench in report.BENCHES:
        assert report.write_into(text, bench, "x")


def test_latency_stages_are_derived_per_request_and_tabulated(tmp_path):
    """bench/latency.py's derived stages from made-up measured ones, and its RESULTS.md table."""
    from bench import latency

    server = {"read": 0.1, "parse": 0.3, "prepare": 6.0, "decode": 1.0, "preprocess": 4.5, "engine": 103.0,
              "queue": 0.1, "encode": 102.0, "forward": 100.0, "respond": 0.2, "request": 110.0}  # fmt: skip
    client = {"connect": 0.1, "write": 0.05, "first_byte": 111.0, "headers": 0.01, "body_gap": 0.05}
    vit = [{**client, **server, "total": 111.5 + k, "num_tokens": 64} for k in range(3)]
    naive = [{**client, "total": 110.0, "server": 109.0, "prep": 4.0, "forward": 104.0, "num_tokens": 64}] * 3
    summary = latency.summarize({"vitserve": vit, "naive": naive})
    v = summary["vitserve"]
    assert v["pool_hops"]["p50"] == pytest.approx(0.5)  # prepare - decode - preprocess
    assert v["zmq_rank_hop"]["p50"] == pytest.approx(2.0)  # encode - forward
    assert v["engine_python"]["p50"] == pytest.approx(0.9)  # engine - queue - encode
    assert v["outside_handler"]["p50"] == pytest.approx(2.5)  # the median request's total - request
    assert v["outside_forward"]["p50"] == pytest.approx(7.0)  # total - forward - decode - preprocess
    assert v["outside_forward"]["p90"] == pytest.approx(8.0)
    assert summary["naive"]["outside_forward"]["p50"] == pytest.approx(2.0)  # total - forward - prep
    assert summary["p50_vs_naive"] == {"vitserve": pytest.approx(112.5 / 110.0, abs=1e-3)}
    sizes = {
        "224x224": {"loadavg": [1.0, 1.0, 1.0], "summary": summary, "rows": {"vitserve": vit, "naive": naive}}
    }
    record.finish(record.begin("latency", {}), {"budget": 4096, "servers": ["vitserve", "naive"], "sizes": sizes},
                  tmp_path)  # fmt: skip
    text = report.section("latency", tmp_path)
    assert "| **_outside the forward_** | 7.00 / 8.00 | 2.00 / 2.00 |" in text
    assert "vitserve **1.023x**" in text


def test_latency_ratios_against_in_process_transformers(tmp_path):
    """Issue 23's two ratios: client p50 over the in-process p50, encode stage over the in-process forward."""
    from bench import latency

    server = {"read": 0.1, "parse": 0.3, "prepare": 6.0, "decode": 1.0, "preprocess": 4.5, "engine": 93.0,
              "queue": 0.1, "encode": 92.0, "forward": 90.0, "respond": 0.2, "request": 100.0}  # fmt: skip
    client = {"connect": 0.1, "write": 0.05, "first_byte": 101.0, "headers": 0.01, "body_gap": 0.05}
    vit = [{**client, **server, "total": 101.5, "num_tokens": 64}] * 3
    naive = [{**client, "total": 110.0, "server": 109.0, "prep": 4.0, "forward": 104.0, "num_tokens": 64}] * 3
    inproc = [{"total": 105.0 + k, "prep": 5.0, "forward": 100.0 + k, "num_tokens": 64} for k in range(3)]
    summary = latency.summarize({"vitserve": vit, "naive": naive, "inprocess": inproc})
    assert summary["inprocess"]["outside_forward"]["p50"] == pytest.approx(0.0)  # total - forward - prep
    assert summary["vs_inprocess"] == {
        "vitserve": {"p50": pytest.approx(101.5 / 106.0, abs=1e-3), "encode_vs_forward": pytest.approx(0.911)}
    }
    sizes = {"224x224": {"loadavg": [1.0] * 3, "summary": summary,
                         "rows": {"vitserve": vit, "naive": naive, "inprocess": inproc}}}  # fmt: skip
    servers = ["vitserve", "naive", "inprocess"]
    record.finish(record.begin("latency", {}), {"budget": 4096, "servers": servers, "sizes": sizes}, tmp_path)
    text = report.section("latency", tmp_path)
    assert "| server: encode (dispatch -> result) | 92.00 / 92.00 | - | - |" in text
    assert "vitserve p50 **0.958x**, encode / HF forward **0.911x**" in text
