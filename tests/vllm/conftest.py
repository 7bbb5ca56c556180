"""Fixtures every tests/vllm module may share."""

from __future__ import annotations

import pytest

from tests.vllm import servers


@pytest.fixture(scope="session")
def connector_vllm(tmp_path_factory):
    """The one vLLM with vitserve's own connector (tests/vllm/connector_server.py), started early beside the
    other vLLMs (tests/vllm/servers.py `take_more`) or on first use, ready when handed over, and stopped at the
    session's end: every module that asks shares it (one start-up, ~1 minute of a core)."""
    started = servers.take_more("connector", tmp_path_factory.mktemp("connector"))
    started.server.wait_ready()
    try:
        yield started
    finally:
        started.server.stop()


@pytest.fixture(scope="session")
def connector_qwen2_5_vl(tmp_path_factory):
    """The other family's connector vLLM (tests/vllm/connector_server.py), shared by tests/vllm/test_wire.py and
    test_pull.py."""
    started = servers.take_more("connector_qwen2_5_vl", tmp_path_factory.mktemp("connector_qwen2_5_vl"))
    try:
        started.server.wait_ready()
        yield started
    finally:
        started.server.stop()


@pytest.fixture(scope="session")
def connector_dp(tmp_path_factory):
    """Qwen2.5-VL with two data-parallel engine cores, pulling (tests/vllm/test_pull.py)."""
    started = servers.take_more("connector_dp", tmp_path_factory.mktemp("connector_dp"))
    try:
        started.server.wait_ready()
        yield started
    finally:
        started.server.stop()
