"""tests/integration: real processes, sockets and gloo ranks. The vLLMs of tests/vllm start while these and the
unit tests run, in a serial run only (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _vllms_start_early(vllms_started_early) -> None:
    """tests/vllm's vLLMs start by the first integration or unit test (tests/conftest.py)."""
