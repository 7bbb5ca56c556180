"""tests/unit: the vLLMs of tests/vllm start while these tests run (a serial run only)."""

from __future__ import annotations

import os

import pytest

from tests.parallel import folder
from tests.vllm import servers


@pytest.fixture(scope="session", autouse=True)
def _vllms_start_beside_the_unit_tests(request, tmp_path_factory):
    """Start tests/vllm's vLLMs when the first unit test begins, if tests/vllm runs after the unit tests
    (tests/vllm/servers.py says why). The unit tests run in this process, one core; the ~1 minute of each
    vLLM start-up then runs on the other instead of while tests/vllm waits (~2 min of a serial run). Not
    under xdist: a worker does not know whether tests/vllm will be its. Whatever tests/vllm did not take is
    stopped when the run ends."""
    items = request.session.items
    first_unit = next((i for i, item in enumerate(items) if folder(item) == "unit"), len(items))
    if "PYTEST_XDIST_WORKER" not in os.environ and any(folder(item) == "vllm" for item in items[first_unit:]):
        servers.start_early(tmp_path_factory.mktemp("vllm"))
    yield
    servers.stop_early()
