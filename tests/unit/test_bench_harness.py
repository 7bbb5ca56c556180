"""bench/harness.py, the shared harness of the benchmarks, and what the merged benches moved into shared
modules (bench/workloads.py's gradient images, bench/report.py's widths table). No benchmark is run."""

from __future__ import annotations

import io
import json
import os

from PIL import Image

from bench import harness, report
from bench.workloads import SIZES, gradient_png


def test_alternate_and_rotate_put_each_arm_first_equally_often():
    arms = ["vllm", "inline", "ec_storage"]
    assert [harness.alternate(arms, i)[0] for i in range(4)] == ["vllm", "ec_storage"] * 2
    assert [harness.rotate(arms, i)[0] for i in range(6)] == arms * 2
    assert all(sorted(harness.rotate(arms, i)) == sorted(arms) for i in range(5))
    assert [harness.rotate(arms[:2], i) for i in range(2)] == [
        harness.alternate(arms[:2], i) for i in range(2)
    ]


def test_sitting_records_the_load_before_and_after_around_the_point():
    with harness.sitting(model="m", size="448px") as point:
        assert "load_after" not in point
        point["vllm"] = {"ttft_p50_s": 1.0}
    assert point["model"] == "m"
    assert point["vllm"] == {"ttft_p50_s": 1.0}
    assert point["load_before"] >= 0
    assert point["load_after"] >= 0


def test_parser_begin_finish_write_the_record_where_out_says(tmp_path, capsys):
    ap = harness.parser("What it compares.\n\nmore", quick="1 repeat")
    args = ap.parse_args(["--quick", "--out", str(tmp_path / "records")])
    assert ap.description == "What it compares."
    run = harness.begin("cache", args)
    path = harness.finish(run, [{"images_per_s": 2.0}], args)
    assert path == tmp_path / "records" / "cache.jsonl"
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["args"] == {"quick": True, "out": str(tmp_path / "records")}
    assert f"Commit `{run['commit']}`" in capsys.readouterr().out  # RESULTS.md's header line for the run


def test_timed_and_pct():
    assert len(harness.timed(lambda: None, 3)) == 3
    assert harness.best_median([3.0, 1.0, 2.0]) == (1.0, 2.0)
    assert harness.pct([], 50) is None
    assert harness.pct([0.5], 99) == 0.5
    assert harness.pct([float(x) for x in range(101)], 50) == 50.0


def test_gradient_png_has_the_size_and_a_seed_makes_it_distinct():
    blob = gradient_png(*SIZES["448px"], seed=1)
    assert Image.open(io.BytesIO(blob)).size == (448, 448)
    assert blob == gradient_png(448, 448, seed=1)
    assert blob != gradient_png(448, 448, seed=2)


def test_gateway_widths_table_gives_each_arm_against_vllm_alone():
    point = {"model": "qwen2_5_vl-3584", "size": "1080p", "load_before": 2.04,
             "vllm": {"ttft_p50_s": 0.5, "requests": 4},
             "inline": {"ttft_p50_s": 0.75, "requests": 4, "upstream_bytes": 1234567, "handover_ms": 12.34}}  # fmt: skip
    lines = report.gateway_widths_table({"points": [point]})
    assert lines[2] == "| qwen2_5_vl-3584 | 1080p | vllm | 0.500 | - / - | - | - | - | - | - | 4 | 2.0 |"
    assert (
        lines[3]
        == "| qwen2_5_vl-3584 | 1080p | inline | 0.750 | - / - | **1.50x** | 1,234,567 | 12.3 | - | - | 4 | 2.0 |"
    )
    assert len(lines) == 4  # no ec_storage arm measured, no row


def test_gateway_widths_table_gives_wire_against_vllm_alone_on_its_own_vllm():
    """wire runs on a second vLLM (vitserve's connector): its ratio is against that vLLM's, not the first's."""
    first = {"model": "m", "size": "448px", "load_before": 1.0, "connector": "ec_example",
             "vllm": {"ttft_p50_s": 0.5, "requests": 4}}  # fmt: skip
    second = {"model": "m", "size": "448px", "load_before": 1.0, "connector": "vitserve",
              "vllm": {"ttft_p50_s": 0.4, "requests": 4},
              "wire": {"ttft_p50_s": 0.44, "requests": 4, "upstream_bytes": 2000, "handover_ms": 5.0}}  # fmt: skip
    lines = report.gateway_widths_table({"points": [first, second]})
    assert lines[2] == "| m | 448px | vllm (ec_example) | 0.500 | - / - | - | - | - | - | - | 4 | 1.0 |"
    assert lines[3] == "| m | 448px | vllm (vitserve) | 0.400 | - / - | - | - | - | - | - | 4 | 1.0 |"
    assert lines[4] == "| m | 448px | wire | 0.440 | - / - | **1.10x** | 2,000 | 5.0 | - | - | 4 | 1.0 |"


def test_process_tree_holds_the_descendants_and_their_cpu_counts():
    """This process is in its parent's tree, not the other way round (a unit test starts no process)."""
    assert os.getpid() in harness.process_tree(os.getppid())
    assert os.getppid() not in harness.process_tree(os.getpid())
    mine = harness.tree_cpu_s(os.getpid())
    assert mine > 0  # the imports above ran
    assert harness.tree_cpu_s(os.getppid()) >= mine  # read after mine: it holds mine and more
