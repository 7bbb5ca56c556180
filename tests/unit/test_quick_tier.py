"""The quick tier's two rules (tests/unit/conftest.py, tests/no_processes.py): a unit test that starts a
process fails, and every HEAVY entry names a test that exists (a stale name would quietly put a costly test
back into the quick tier, or leave a renamed one out of nothing)."""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from tests import no_processes
from tests.unit.conftest import HEAVY

UNIT = Path(__file__).parent


def test_the_guard_refuses_every_way_to_start_a_process():
    # These run inside a unit test, so the guard is active: each call is refused before anything starts.
    with pytest.raises(no_processes.ProcessInUnitTest, match="move the test to tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(no_processes.ProcessInUnitTest):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(no_processes.ProcessInUnitTest):
        multiprocessing.get_context("fork").Process(target=print).start()


def test_the_guard_lets_git_run_and_is_off_when_allowed():
    assert subprocess.run(["git", "--version"], capture_output=True, check=True).returncode == 0
    with no_processes.allowed():
        assert subprocess.run(["true"], check=True).returncode == 0


def _test_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("entry", sorted(HEAVY))
def test_every_heavy_entry_names_an_existing_test(entry):
    module, _, name = entry.partition("::")
    assert (UNIT / module).is_file(), entry
    if name:
        assert name in _test_names(UNIT / module), entry
    assert HEAVY[entry], "each entry says what it costs"
