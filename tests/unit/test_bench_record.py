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


def test_results_md_has_a_marker_pair_for_every_benchmark():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    for bench in report.BENCHES:
        assert report.write_into(text, bench, "x")
