"""Fixtures every tests/vllm module may share."""

from __future__ import annotations

import pytest

from tests.vllm import connector_server


@pytest.fixture(scope="session")
def connector_vllm(tmp_path_factory):
    """The one vLLM with vitserve's own connector (tests/vllm/connector_server.py), started on first use and
    stopped at the session's end: every module that asks shares it (one start-up, ~1 minute of a core)."""
    started = connector_server.start(tmp_path_factory.mktemp("connector"))
    try:
        yield started
    finally:
        started.server.stop()
