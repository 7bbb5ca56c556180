"""tests/parallel.py: which tests share an xdist worker, and the lock that runs a `solo` test alone."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests import parallel


@pytest.mark.parametrize(
    ("nodeid", "unit"),
    [
        # every real-vLLM test: one unit, so each vLLM server starts once
        ("tests/vllm/test_front_door.py::test_a[qwen3_vl]", "tests/vllm"),
        # a document's blocks share its server
        (
            "tests/integration/test_doc_blocks.py::test_doc_block[docs/vllm.md:40]",
            "tests/integration/test_doc_blocks.py::docs/vllm.md",
        ),
        (
            "tests/integration/test_doc_blocks.py::test_doc_block[README.md:46]",
            "tests/integration/test_doc_blocks.py::README.md",
        ),
        # a module with a module-scoped fixture (its live server): one unit
        ("tests/e2e/test_api_errors.py::test_normal_request_succeeds", "tests/e2e/test_api_errors.py"),
        # no shared fixture: each test on its own
        ("tests/unit/test_package.py::test_x", "tests/unit/test_package.py::test_x"),
    ],
)
def test_units_of_work(nodeid, unit):
    assert parallel.unit_of(nodeid) == unit


def test_every_module_scoped_fixture_is_seen():
    """A module that shares a fixture must be one unit: the source check finds every such module."""
    root = Path(parallel.__file__).parent
    for path in root.rglob("test_*.py"):
        text = path.read_text()
        if 'scope="module"' in text or 'scope="class"' in text:
            nodeid = f"{path.relative_to(root.parent)}::test_x"
            assert parallel.unit_of(nodeid) != nodeid, nodeid


def _item(tmp_path: Path, solo: bool):
    config = types.SimpleNamespace(option=types.SimpleNamespace(basetemp=str(tmp_path / "gw0")))
    return types.SimpleNamespace(
        config=config, get_closest_marker=lambda name: name == "solo" and solo or None
    )


def _take_turn(tmp_path: Path, solo: bool, entered, leave) -> None:
    with parallel.turn(_item(tmp_path, solo)):
        entered.set()
        leave.wait(60)


def test_without_xdist_there_is_no_lock(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with parallel.turn(_item(tmp_path, solo=True)):
        assert not list(tmp_path.iterdir())
