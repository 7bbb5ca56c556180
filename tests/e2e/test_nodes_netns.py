"""Two vitserve nodes in two network namespaces joined by a veth pair: node 1 reaches node 0 only over it.

Node 0 runs here with its end of the pair (10.231.N.1); node 1 runs in a namespace of its own with the
other end (10.231.N.2) and its own loopback, so the store, gloo and liveness all cross the veth link, as
between two machines. Setting up namespaces needs root (CAP_NET_ADMIN): the test skips, saying why,
where `ip netns` is refused; test_nodes.py covers the same over loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_nodes import FAMILY, assert_encodes_like_transformers, start_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def veth():
    """{"ns", "here", "there", "addr0", "addr1"}: a namespace holding `there`, the peer of `here`."""
    ip = shutil.which("ip")
    if ip is None:
        pytest.skip("no `ip` tool (iproute2) here; the nodes are tested over loopback only")
    tag = f"vs{os.getpid() % 100000}"
    net = f"10.231.{os.getpid() % 250}"
    ns, here, there = f"{tag}ns", f"{tag}a", f"{tag}b"
    steps = [
        ["netns", "add", ns],
        ["link", "add", here, "type", "veth", "peer", "name", there],
        ["link", "set", there, "netns", ns],
        ["addr", "add", f"{net}.1/24", "dev", here],
        ["link", "set", here, "up"],
        ["netns", "exec", ns, ip, "addr", "add", f"{net}.2/24", "dev", there],
        ["netns", "exec", ns, ip, "link", "set", there, "up"],
        ["netns", "exec", ns, ip, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            done = subprocess.run([ip, *step], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` is refused here ({done.stderr.strip()})")
        yield {"ns": ns, "here": here, "there": there, "addr0": f"{net}.1", "addr1": f"{net}.2"}
    finally:
        subprocess.run([ip, "netns", "delete", ns], capture_output=True)  # takes `there` with it
        subprocess.run([ip, "link", "delete", here], capture_output=True)  # gone already, normally


def test_two_nodes_over_a_veth_pair(veth, tmp_path):
    path = make_checkpoint(FAMILY, tmp_path / "ckpt")
    ip = shutil.which("ip")
    node0, node1 = start_pair(
        tmp_path,
        str(path),
        store_addr=veth["addr0"],
        node0={"ifname": veth["here"]},
        node1={"ifname": veth["there"], "prefix": (ip, "netns", "exec", veth["ns"])},
    )
    try:
        assert f"waiting for node 0 at {veth['addr0']}:" in node1.text
        assert_encodes_like_transformers(f"http://127.0.0.1:{node0.port}", path)
        node0.proc.send_signal(signal.SIGTERM)  # a clean stop reaches node 1 over the link too
        assert node0.proc.wait(60) == 0
        assert node1.proc.wait(60) == 0, node1.text[-3000:]
        assert "node 0 stopped the group; exiting" in node1.text
    finally:
        node0.stop()
        node1.stop()
