"""TP=2 across two vitserve "nodes" on this machine, one rank each, over loopback: real CLI processes.

Node 1 waits for node 0 (it says so); node 0 serves HTTP. Gloo finds its interface from
GLOO_SOCKET_IFNAME=lo, as a deployment names its NIC (docs/engine.md, Nodes). Each node runs in its own
session, so that "killing node 1" kills every process of it at once, as when a machine dies.

The same over a veth pair between network namespaces: test_nodes_netns.py (where `ip netns` works). A hung
node, in-flight requests, clean stops and signals: test_nodes_faults.py.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import torch

from tests.checkpoints import hf_reference, make_checkpoint
from tests.cli import CLI, Cli
from tests.e2e.test_tp2_exact import ATOL, decode_tensor, hf_rows
from tests.imagegen import encode, noise
from tests.ports import unused_port

pytestmark = pytest.mark.timeout(300)
FAMILY = "qwen3_vl"
HEARTBEAT_S = 2.0
IMAGES = [(700, 500, "JPEG"), (120, 90, "PNG")]  # clamped by the tiny checkpoint's max_pixels, and not


def start_node(rank: int, args: list[str], tmp_path, *, ifname: str = "lo", prefix: tuple = ()) -> Cli:
    """`python -m vitserve.cli ... --node_rank N` in its own session (signal_all reaches all of it).

    `prefix`: what runs the command (`ip netns exec NS`); a prefix ending in torchrun's own flags runs
    `-m vitserve.cli` under it, and the node's rank comes from torchrun's environment."""
    under_torchrun = "torch.distributed.run" in prefix
    if under_torchrun:
        command = [*prefix, *CLI[1:]]
    else:
        command = [*prefix, *CLI]
        args = [*args, "--node_rank", str(rank)]
    return Cli(args, tmp_path, extra_env={"GLOO_SOCKET_IFNAME": ifname}, command=command, session=True)


def node_args(model: str, store_addr: str = "127.0.0.1") -> tuple[list[str], int]:
    """Flags every node gets (TP=2 over two nodes, one rank each), and the store's port."""
    store_port = unused_port()
    args = ["--model", model, "--tp", "2", "--nnodes", "2", "--master_addr", store_addr]
    args += ["--master_port", str(store_port), "--heartbeat_s", str(HEARTBEAT_S), "--device", "cpu"]
    args += ["--visual_reserved_mem_gb", "0.5"]  # skips the start-up stress only (see test_tp2_exact.py)
    return args, store_port


def start_pair(tmp_path, model: str, store_addr: str = "127.0.0.1", **kwargs: dict) -> list[Cli]:
    """Node 0 (serving on an ephemeral port) and node 1 (ranks only), both up. kwargs `node0` and `node1`:
    what each start_node() gets besides (its interface, a command prefix)."""
    args, store_port = node_args(model, store_addr)
    nodes = [start_node(0, [*args, "--port", "0"], tmp_path / "n0", **kwargs.get("node0", {}))]
    try:
        nodes.append(start_node(1, args, tmp_path / "n1", **kwargs.get("node1", {})))
        nodes[1].wait_for(f"waiting for node 0 at {re.escape(store_addr)}:{store_port}", 120)
        nodes[0].wait_for(r"serving on http://")
        nodes[1].wait_for("every rank here is up")
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


@pytest.fixture
def two_nodes(tmp_path):
    """Node 0 (serving) and node 1 (ranks only, waiting for node 0) over a tiny real Qwen3-VL checkpoint."""
    path = make_checkpoint(FAMILY, tmp_path / "ckpt")
    nodes = start_pair(tmp_path, str(path))
    try:
        yield path, nodes
    finally:
        for node in nodes:
            node.stop()


def poll_ready(url: str, limit_s: float) -> list[tuple[float, int]]:
    """(time, status) of /ready every 20 ms until it answers non-200 or refuses (status 0) twice."""
    seen: list[tuple[float, int]] = []
    end = time.monotonic() + limit_s
    with httpx.Client(base_url=url, timeout=2, trust_env=False) as http:
        while time.monotonic() < end and sum(code != 200 for _, code in seen) < 2:
            try:
                code = http.get("/ready").status_code
            except httpx.TransportError:
                code = 0
            seen.append((time.monotonic(), code))
            time.sleep(0.02)
    return seen


def assert_encodes_like_transformers(url: str, path) -> None:
    """/encode on node 0 returns, for a JPEG and a PNG, what transformers' own tower computes (1e-4)."""
    images = [encode(noise(w, h, seed=i), fmt) for i, (w, h, fmt) in enumerate(IMAGES)]
    files = [("images", (f"image{i}", data, "application/octet-stream")) for i, data in enumerate(images)]
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        info = http.get("/v1/info").json()
        resp = http.post("/encode", files=files, data={"return_embeddings": "true"})
    assert (info["tp"], info["dp"]) == (2, 1)
    assert resp.status_code == 200, resp.text
    reference = hf_reference(path, FAMILY)
    for data, got in zip(images, resp.json()["images"], strict=True):
        _, grid, want, want_deep = hf_rows(path, reference, data)
        assert got["grid_thw"] == grid
        torch.testing.assert_close(decode_tensor(got["embedding"]), want, rtol=0, atol=ATOL)
        for layer, want_layer in zip(got["deepstack"], want_deep, strict=True):
            torch.testing.assert_close(decode_tensor(layer), want_layer, rtol=0, atol=ATOL)


def test_two_nodes_encode_like_transformers_and_a_dead_node_fails_ready(two_nodes):
    path, (node0, node1) = two_nodes
    url = f"http://127.0.0.1:{node0.port}"
    assert_encodes_like_transformers(url, path)

    killed = time.monotonic()
    node1.signal_all(signal.SIGKILL)
    seen = poll_ready(url, limit_s=4 * HEARTBEAT_S)
    first_down = next(at for at, code in seen if code != 200)
    failed_at = node0.wait_for("encoder group 0 failed", 30)
    print(
        f"\nnode 1 killed: node 0's /ready not 200 after {first_down - killed:.2f} s, group failure logged "
        f"after {failed_at - killed:.2f} s (--heartbeat_s {HEARTBEAT_S:g}); statuses seen after 200: "
        f"{[code for _, code in seen if code != 200]}"
    )
    assert first_down - killed <= 2 * HEARTBEAT_S, node0.text[-3000:]
    # the group is gone and cannot be replaced: node 0 exits 1 (docs/api.md), as with a dead local rank
    assert node0.proc.wait(30) == 1
    assert "Connection closed by peer" in node0.text or "missed heartbeats" in node0.text


@pytest.mark.parametrize(
    ("flags", "env", "names"),
    [
        (["--tp", "3", "--nnodes", "2", "--master_addr", "10.0.0.1"], {}, "--tp 3 cannot be split over"),
        (["--tp", "2", "--nnodes", "2"], {}, "--nnodes 2 needs --master_addr"),
        (
            ["--tp", "2"],
            {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
            "--nproc_per_node 1",
        ),
    ],
)
def test_impossible_node_layouts_exit_2_with_one_line(tmp_path, flags, env, names):
    done = Cli.run(["--model", "demo", *flags], tmp_path, **env)
    assert done.returncode == 2
    assert names in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
