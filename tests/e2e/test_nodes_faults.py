"""Two vitserve nodes (TP=2, one rank each, demo tower) on this machine: a hung node, stops and signals.

Each test starts its own pair (~40 s on the 2-core machine), so they are `slow`; test_nodes.py covers the
exact embeddings and a dead node in the default run.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.live import noise_png
from tests.e2e.test_nodes import HEARTBEAT_S, node_args, poll_ready, start_node, start_pair
from tests.ports import unused_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def pair(tmp_path):
    nodes = start_pair(tmp_path, "demo")
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_a_hung_node_fails_the_request_in_flight_and_ready_within_two_heartbeats(pair):
    """SIGSTOP keeps node 1's sockets open, so gloo sees nothing: only the liveness relayed through the
    store can tell. The request waits in rank 0's all_reduce and must fail long before --dist_timeout_s."""
    node0, node1 = pair
    url = f"http://127.0.0.1:{node0.port}"
    node1.signal_all(signal.SIGSTOP)
    stopped = time.monotonic()
    answer: dict = {}

    def post() -> None:
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
            answer["resp"] = http.post("/encode", files=[("images", ("a", noise_png(96, 96), "image/png"))])
            answer["at"] = time.monotonic()

    client = threading.Thread(target=post)
    client.start()
    seen = poll_ready(url, limit_s=6 * HEARTBEAT_S)
    client.join(60)
    node1.signal_all(signal.SIGCONT)
    first_down = next(at for at, code in seen if code != 200)
    print(
        f"\nnode 1 stopped: node 0's /ready not 200 after {first_down - stopped:.2f} s, the request in flight "
        f"answered {answer['resp'].status_code} after {answer['at'] - stopped:.2f} s "
        f"(--heartbeat_s {HEARTBEAT_S:g}, --dist_timeout_s default 1800 s)"
    )
    assert answer["resp"].status_code == 503, answer["resp"].text
    assert answer["resp"].json()["error"]["code"] == "encoder_failed"
    assert "missed heartbeats" in answer["resp"].text
    assert "node 1" in answer["resp"].text
    # 2 heartbeats after the last count rank 0 read (<= 0.25 s after the stop), plus a loaded machine
    assert first_down - stopped <= 2 * HEARTBEAT_S + 1.5, node0.text[-3000:]
    assert node0.proc.wait(30) == 1
    # node 1, resumed, finds node 0 gone and says so
    assert node1.proc.wait(60) == 1
    assert "node 0 at 127.0.0.1" in node1.text
    assert "went away" in node1.text


def test_node_0_stopping_ends_node_1_cleanly(pair):
    node0, node1 = pair
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.proc.wait(60) == 0
    assert node1.proc.wait(60) == 0, node1.text[-3000:]
    assert "node 0 stopped the group; exiting" in node1.text


def test_signals_on_a_node_that_waits_for_node_0(tmp_path):
    """A node still waiting exits 128 + N (stopped before serving); no rank process is left behind."""
    args, _ = node_args("demo")
    node = start_node(1, args, tmp_path)
    try:
        node.wait_for("waiting for node 0")
        node.wait_for(r"\[group 0\] \+[0-9.]+ s waiting for node 0")  # the rank itself waits in the store
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(30) == 128 + signal.SIGTERM
    finally:
        node.stop()
    assert "stopped by SIGTERM" in node.text


def test_two_nodes_under_torchrun_meet_at_its_agent_store(tmp_path):
    """torchrun --nproc_per_node 1 on each node: vitserve takes the node flags from torchrun's environment
    and joins the store torchrun's agent hosts (TORCHELASTIC_USE_AGENT_STORE=True)."""
    store_port = unused_port()
    args = ["--model", "demo", "--tp", "2", "--heartbeat_s", str(HEARTBEAT_S), "--device", "cpu"]
    args += ["--visual_reserved_mem_gb", "0.5"]

    def torchrun(rank: int) -> tuple:
        return (
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(store_port),
        )

    nodes = [start_node(0, [*args, "--port", "0"], tmp_path / "n0", prefix=torchrun(0))]
    try:
        nodes.append(start_node(1, args, tmp_path / "n1", prefix=torchrun(1)))
        nodes[1].wait_for(f"node 1 of 2: ranks 1..1 of --tp 2; waiting for node 0 at 127.0.0.1:{store_port}")
        nodes[0].wait_for(r"serving on http://")
        nodes[1].wait_for("every rank here is up")
        with httpx.Client(base_url=f"http://127.0.0.1:{nodes[0].port}", timeout=60, trust_env=False) as http:
            resp = http.post("/encode", files=[("images", ("a", noise_png(96, 96), "image/png"))])
        assert resp.status_code == 200, resp.text
        assert resp.json()["images"][0]["num_tokens"] > 0
    finally:  # torchrun passes SIGTERM on to its worker (in a session of its own) and waits for it
        for node in nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(60)
            node.stop()
