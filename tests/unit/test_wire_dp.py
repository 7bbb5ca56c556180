"""--llm_transport wire --llm_dp_size N (docs/vllm.md, "Push to data-parallel cores"; handover/wire_ranks.py):
the flag's refusals, one sender per engine core at --llm_endpoint + its rank, the rank each request is pinned to
(fewest in flight, ties in turn) and named to vLLM (X-data-parallel-rank), each request's embeddings pushed to
its rank's connector only, and /ready waiting for every rank. The peers are real ZMQ ROUTERs answering as the
connector does (tests/unit/test_wire_transport.py `Peer`); the real vLLM with two engine cores is
tests/vllm/test_pull.py's."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from tests.unit.test_wire_transport import Peer, _encoded, _inline
from vitserve import cli
from vitserve.config import Config
from vitserve.endpoints import rank_endpoint
from vitserve.errors import ConfigError
from vitserve.flags import build_config
from vitserve.handover.base import Setup
from vitserve.handover.embeds import EmbedsLayout
from vitserve.handover.wire import WireTransport, config_hint
from vitserve.handover.wire_ranks import RANK_HEADER
from vitserve.metrics import Metrics

WIRE = ["--llm_url", "http://h:1", "--llm_transport", "wire", "--llm_endpoint"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*WIRE, "tcp://127.0.0.1:5600", "--llm_dp_size", "0"], "--llm_dp_size must be >= 1"),
        ([*WIRE, "tcp://127.0.0.1:65535", "--llm_dp_size", "2"], "tcp://127.0.0.1:65536, past port 65535"),
        ([*WIRE, "tcp://127.0.0.1:0", "--llm_dp_size", "2"], "needs --llm_endpoint with a port"),
        (
            ["--llm_url", "http://h:1", "--llm_transport", "pull", "--pull_bind", "tcp://127.0.0.1:1",
             "--llm_dp_size", "2"],
            "--llm_dp_size is used only with --llm_transport wire",
        ),
        (["--llm_url", "http://h:1", "--llm_dp_size", "2"], "--llm_dp_size is used only with --llm_transport wire"),
    ],
)  # fmt: skip
def test_a_data_parallel_size_that_cannot_work_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(argv, {})


def test_the_refusal_is_the_clis_exit_2_and_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "install_stop_handlers", lambda: None)  # pytest's own handlers stay
    assert cli.main([*WIRE, "tcp://127.0.0.1:5600", "--llm_dp_size", "-1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line
        == "vitserve: start-up failed: --llm_dp_size must be >= 1, vLLM's --data-parallel-size (its engine cores), got -1"
    )


def test_each_rank_is_the_connectors_own_offset():
    """vitserve pushes where each engine core's connector binds: one function for both ends."""
    assert [rank_endpoint("tcp://10.0.0.5:5600", i) for i in range(3)] == [
        "tcp://10.0.0.5:5600",
        "tcp://10.0.0.5:5601",
        "tcp://10.0.0.5:5602",
    ]
    assert rank_endpoint("ipc:///run/c.sock", 1) == "ipc:///run/c.sock-1"
    assert build_config([*WIRE, "ipc:///run/c.sock", "--llm_dp_size", "4"], {}).llm_dp_size == 4
    assert build_config([*WIRE, "tcp://127.0.0.1:5600"], {}).llm_dp_size is None  # one engine core
    hint = config_hint("tcp://127.0.0.1:5600", None, 2)
    assert "--data-parallel-size 2 --ec-transfer-config" in hint
    assert '"dp_push":true' in hint


def _two_peers() -> tuple[Peer, Peer]:
    """Two connectors on consecutive ports, as vLLM's two engine cores bind them."""
    for _ in range(20):
        first = Peer()
        try:
            return first, Peer(port=int(first.endpoint.rpartition(":")[2]) + 1)
        except zmq.ZMQError:
            first.close()
    raise AssertionError("no two consecutive free ports")


def _wire(endpoint: str, size: int) -> WireTransport:
    layout = EmbedsLayout(family="qwen3_vl", merge_size=2, width=24)
    config = Config(request_timeout_s=10, llm_endpoint=endpoint, llm_dp_size=size)
    return WireTransport(Setup(config, layout, Metrics(), _inline, lambda: "fingerprint"))


def test_each_request_is_pinned_to_the_least_busy_rank_and_pushed_to_its_connector_only():
    zero, one = _two_peers()
    wire = _wire(zero.endpoint, 2)
    try:
        assert all(rank.sender.wait_reachable(10) for rank in wire.ranks.all)
        assert wire.readiness() is None
        first, second = wire.begin(), wire.begin()  # both in flight: one per rank
        assert [first.upstream_headers(), second.upstream_headers()] == [
            {RANK_HEADER: "0"},
            {RANK_HEADER: "1"},
        ]
        for request, data in ((first, b"first"), (second, b"second")):
            request.image_part(*_encoded(data), 0)
            asyncio.run(request.ready({"messages": []}))
        assert [len(zero.received), len(one.received)] == [1, 1]
        assert zero.received[0].uuid == first.messages[0].uuid
        assert one.received[0].uuid == second.messages[0].uuid
        first.release()
        third = wire.begin()  # rank 0 has none in flight now, rank 1 one
        assert third.upstream_headers() == {RANK_HEADER: "0"}
        second.release()
        third.release()
        third.release()  # idempotent: counted once
        assert [r.in_flight for r in wire.ranks.all] == [0, 0]
        picks = []
        for _ in range(4):  # none in flight: in turn
            request = wire.begin()
            picks.append(request.upstream_headers()[RANK_HEADER])
            request.release()
        assert picks == ["1", "0", "1", "0"]
    finally:
        asyncio.run(wire.close())
        zero.close()
        one.close()


def test_ready_waits_for_every_ranks_connector_and_a_lone_rank_sends_no_header():
    zero, one = _two_peers()
    port = one.endpoint
    one.close()  # rank 1's engine core is not up
    wire = _wire(zero.endpoint, 2)
    try:
        assert wire.ranks.all[0].sender.wait_reachable(10)
        assert wire.readiness() == (
            f"no vitserve connector is connected at {port} (data-parallel rank 1 of --llm_dp_size 2, "
            f"--llm_endpoint {zero.endpoint})"
        )
        request = wire.begin()  # only rank 0 is connected: every request goes there
        assert [request.upstream_headers(), wire.begin().upstream_headers()] == [{RANK_HEADER: "0"}] * 2
    finally:
        asyncio.run(wire.close())
        zero.close()
    single, _ = _two_peers()
    wire = _wire(single.endpoint, 1)
    try:
        assert wire.begin().upstream_headers() == {}
    finally:
        asyncio.run(wire.close())
        single.close()
        _.close()
