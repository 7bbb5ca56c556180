"""bench/gateway.py's profiles without running one: the arguments each takes (--rounds' default per profile, bad
values refused naming the flag), the tails a point reports as far as its rounds reach, and the tables of the
pull arm (--widths) and of the balancer (--balancer)."""

from __future__ import annotations

import pytest

from bench import gateway, gateway_balancer, gateway_parts, report


def test_rounds_default_per_profile_and_quick():
    assert gateway.options(["--widths"]).rounds == 8  # issue 51: at least 8
    assert gateway.options(["--widths", "--quick"]).rounds == 2
    assert gateway.options(["--balancer"]).rounds == gateway_balancer.ROUNDS
    assert gateway.options(["--balancer", "--quick", "--rounds", "3"]).rounds == 3
    assert "pull" in gateway.options(["--widths"]).transports.split(",")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--widths", "--balancer"], "--balancer"),
        (["--widths", "--rounds", "0"], "--rounds"),
        (["--widths", "--transports", "wire,pul"], "--transports"),
        (["--balancer", "--size", "4k"], "--size"),
    ],
)
def test_a_bad_argument_is_refused_naming_its_flag(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        gateway.options(argv)
    assert exit_.value.code == 2
    assert names in capsys.readouterr().err


def test_tails_give_p90_and_p99_only_where_the_samples_reach():
    assert gateway_parts.tails([1.0] * 9) == {"ttft_p50_s": 1.0}
    ten = gateway_parts.tails([float(x) for x in range(10)])
    assert set(ten) == {"ttft_p50_s", "ttft_p90_s"}
    assert ten["ttft_p50_s"] == 4.5
    assert set(gateway_parts.tails([1.0] * 100)) == {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s"}


def test_gateway_widths_table_gives_pull_against_the_vllm_of_its_sitting_with_its_tails():
    point = {"model": "m", "size": "1080p", "load_before": 1.0, "connector": "vitserve",
             "vllm": {"ttft_p50_s": 2.0, "ttft_p90_s": 2.5, "requests": 10},
             "wire": {"ttft_p50_s": 2.1, "requests": 10, "upstream_bytes": 327, "handover_ms": 60.0},
             "pull": {"ttft_p50_s": 2.2, "ttft_p90_s": 2.75, "requests": 10, "upstream_bytes": 400,
                      "handover_ms": 1.5, "fetch_ms": 69.1,
                      "in_vllm_ms": {"vllm_ttft_s": 1445.0, "queue_s": 71.0, "prefill_s": 1367.9,
                                     "cpu_engine_core": 960.4, "cpu_worker": 2500.0}}}  # fmt: skip
    lines = report.gateway_widths_table({"points": [point]})
    assert lines[2] == "| m | 1080p | vllm (vitserve) | 2.000 | 2.500 / - | - | - | - | - | - | 10 | 1.0 |"
    assert (
        lines[4]
        == "| m | 1080p | pull | 2.200 | 2.750 / - | **1.10x** | 400 | 1.5 | 71 / 1368 (core 960) | 69.1 | 10 | 1.0 |"
    )


def test_balancer_table_gives_pull_against_the_raw_images_through_the_same_nginx():
    def arm(req_per_s, p50, p99, **more):
        return {"requests": 40, "req_per_s": req_per_s, "ttft_p50_s": p50, "ttft_p99_s": p99, "errors": {},
                "per_engine": [20, 20], **more}  # fmt: skip

    point = {"size": "1080p", "load_before": 2.0, "vllm": arm(0.5, 4.0, 8.0),
             "pull": arm(0.45, 5.0, 8.0, handover_ms=3.25, errors={"502": 1})}  # fmt: skip
    lines = gateway_balancer.table({"points": [point]})
    assert lines[2] == "| 1080p | vllm | 40 | 0.500 | - | 4.00 / 8.00 | - | - | 20 / 20 | - | 0 | 2.0 |"
    assert lines[3] == (
        "| 1080p | pull | 40 | 0.450 | **0.90x** | 5.00 / 8.00 | **1.25x** | **1.00x** | 20 / 20 | 3.2 | 1 | 2.0 |"
    )
