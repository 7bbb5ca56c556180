"""The import graph of vitserve has no cycle anywhere: every import counted (lazy ones inside functions
too, as import-linter counts them; TYPE_CHECKING-only ones not, as pyproject's contracts exclude them)."""

from __future__ import annotations

import sys

import grimp
import pytest

pytestmark = pytest.mark.unit


def cycles(package: str) -> list[tuple[str, str]]:
    """Every import a -> b for which b also reaches a: the edges that lie on a cycle."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    return sorted(
        (a, b)
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if graph.chain_exists(importer=b, imported=a)
    )


def test_vitserve_imports_run_one_way():
    assert cycles("vitserve") == []


def test_the_benchmarks_import_one_way():
    """bench/ too: gpu_check_parts.py and gpu_check_speed.py share gpu_check_shapes.py, never each other."""
    assert cycles("bench") == []


def test_a_cycle_is_found(tmp_path, monkeypatch):
    """The check above can fail: a lazy import that closes a circle, as engine/local_cache.py once had."""
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cache.py").write_text("def open_shared():\n    from circle import shared\n")
    (package / "shared.py").write_text("from circle import jobs\n")
    (package / "jobs.py").write_text("from circle import cache\n")
    (package / "top.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circle import jobs\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert cycles("circle") == [
            ("circle.cache", "circle.shared"),
            ("circle.jobs", "circle.cache"),
            ("circle.shared", "circle.jobs"),
        ]
    finally:
        for name in [m for m in sys.modules if m == "circle" or m.startswith("circle.")]:
            del sys.modules[name]
