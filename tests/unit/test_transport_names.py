"""The transports are known by name in one place: the start-up table (vitserve/transport_specs.py) and the
classes that extend it (vitserve/handover/). The engine, the API, preflight.py and the flags ask the table;
a string that is a transport's name there means a new transport would have to edit them too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vitserve.handover.transports import TRANSPORTS
from vitserve.transport_specs import SPECS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "vitserve"
# Outside the table: every module of these (pull is the next transport, SPEC.md §13).
NO_NAMES = ("engine", "api", "flags", "preflight.py")
NAMES = frozenset(SPECS) | {"pull"}


def named_transports(source: str, names: frozenset[str] = NAMES) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is a transport's name (comments and prose do not count)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def _modules() -> list[Path]:
    out: list[Path] = []
    for name in NO_NAMES:
        path = ROOT / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def test_no_transport_is_named_outside_the_table():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line} {name!r}"
        for path in _modules()
        for line, name in named_transports(path.read_text())
    ]
    assert found == [], "ask vitserve/transport_specs.py (spec_of, SPECS) instead"


def test_the_check_finds_a_name_in_code_and_not_in_prose():
    source = (
        '"""--llm_transport wire pushes."""\n'
        "# with ec_storage\n"
        'if config.llm_transport != "wire":\n'
        '    table = {"pull": 1, "wire_key": 2}\n'
    )
    assert named_transports(source) == [(3, "wire"), (4, "pull")]


def test_each_transport_class_extends_its_start_up_facts():
    """The classes' table (handover/transports.py) and the start-up table name the same transports, and each
    class is its spec's: it answers its preflight, flag checks and banner line."""
    assert list(TRANSPORTS) == list(SPECS)
    for name, cls in TRANSPORTS.items():
        assert issubclass(cls, SPECS[name]), name
        assert cls.name == name
