"""The protected mode's rule (vitserve/endpoints.py): which endpoints only this host can reach."""

from __future__ import annotations

import pytest

from vitserve.endpoints import host_only


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5600",
        "tcp://127.9.9.9:1",
        "tcp://[::1]:5600",
        "tcp://localhost:5600",
        "ipc:///tmp/x.sock",
    ],
)
def test_loopback_and_unix_sockets_are_host_only(endpoint):
    assert host_only(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://0.0.0.0:5600",
        "tcp://*:5600",
        "tcp://[::]:5600",
        "tcp://10.0.0.5:5600",
        "tcp://eth0:5600",
        "tcp://vllm.internal:5600",
        "tcp://eth0;127.0.0.1:5600",
        "udp://127.0.0.1:5600",
        "127.0.0.1:5600",
    ],
)
def test_anything_that_may_face_a_network_is_not(endpoint):
    assert not host_only(endpoint)
