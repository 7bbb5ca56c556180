"""Fixtures every tests/vllm module may share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vllm import servers
from tests.vllm.connector_server import ConnectorVllm


@pytest.fixture(scope="session")
def connector_vllm(tmp_path_factory):
    """The one vLLM with vitserve's own connector (tests/vllm/connector_server.py), started early beside the
    other vLLMs (tests/vllm/servers.py `take_more`) or on first use, ready when handed over, and stopped at the
    session's end: every module that asks shares it (one start-up, ~1 minute of a core)."""
    yield from _served("connector", tmp_path_factory)


@pytest.fixture(scope="session")
def connector_qwen2_5_vl(tmp_path_factory):
    """The other family's connector vLLM (tests/vllm/connector_server.py), shared by tests/vllm/test_wire.py and
    test_pull.py."""
    yield from _served("connector_qwen2_5_vl", tmp_path_factory)


@pytest.fixture(scope="session")
def connector_dp(tmp_path_factory):
    """Qwen2.5-VL with two data-parallel engine cores, pulling (tests/vllm/test_pull.py)."""
    yield from _served("connector_dp", tmp_path_factory)


def _served(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectorVllm]:
    """tests/vllm/servers.py's `name` vLLM, started early or now, once ready; stopped when the session ends."""
    started = servers.take_more(name, tmp_path_factory.mktemp(name))
    try:
        started.server.wait_ready()
        yield started
    finally:
        started.server.stop()
