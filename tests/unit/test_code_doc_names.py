"""The code's own prose names only what exists: module docstrings, class and function docstrings, and comments
in vitserve/ (tests/unit/test_doc_names.py checks README.md and docs/*.md the same way).

- every `vitserve.x.y` imports and resolves (test_doc_names.missing_module_names);
- every repository path (`engine/feed.py`, `vitserve/api/server.py`, `docs/wire.md`, `tests/fakes.py`) is a
  file: relative to the repository or to vitserve/; a path into a third-party package (`vllm/...`,
  `transformers/...`) is not checked;
- every bare file name (`rank.py`) is the name of a file in the repository;
- "wire vN" / "wire-vN" names the version vitserve speaks (rpc/wire.py WIRE_VERSION): an older one in prose
  is a name that outlived its change.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docblocks import ROOT
from tests.unit.test_doc_names import missing_module_names
from vitserve.rpc.wire import WIRE_VERSION

_PATH = re.compile(r"(?<![\w./-])((?:[a-z_][\w-]*/)+[\w-]+\.(?:py|md|toml|json|sh|txt))\b")
_BARE = re.compile(r"(?<![\w./-])([a-z_]\w*\.py)\b")
_WIRE = re.compile(r"\bwire[- ]v(\d+)\b", re.IGNORECASE)
_TOP = ("vitserve", "tests", "docs", "bench", "scripts", "docker")
SOURCES = sorted((ROOT / "vitserve").rglob("*.py"))


def prose(source: str) -> Iterator[str]:
    """The docstrings and the comments of one Python source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.string


@functools.cache
def _files() -> tuple[frozenset[str], frozenset[str]]:
    paths = {
        p.relative_to(ROOT).as_posix()
        for top in _TOP
        if (ROOT / top).is_dir()
        for p in (ROOT / top).rglob("*")
        if p.is_file()
    }
    paths |= {p.name for p in ROOT.iterdir() if p.is_file()}
    return frozenset(paths), frozenset(Path(p).name for p in paths)


def _ours(path: str) -> bool:
    """A path into the repository: one that starts at its top or at a folder of vitserve/."""
    first = path.split("/", 1)[0]
    return first in _TOP or (ROOT / "vitserve" / first).is_dir()


def missing_in_prose(text: str) -> list[str]:
    paths, names = _files()
    missing = [
        m.group(1)
        for m in _PATH.finditer(text)
        if _ours(m.group(1)) and m.group(1) not in paths and f"vitserve/{m.group(1)}" not in paths
    ]
    missing += [m.group(1) for m in _BARE.finditer(text) if m.group(1) not in names]
    missing += [m.group(0) for m in _WIRE.finditer(text) if int(m.group(1)) != WIRE_VERSION]
    return missing + missing_module_names(text)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_names_only_what_exists(source):
    found = [name for text in prose(source.read_text()) for name in missing_in_prose(text)]
    assert found == []


def test_the_check_catches_names_that_are_gone():
    gone = '''"""Reads vitserve/flags.py and engine/adopt.py (beside rank.py and budgetx.py), sends wire-v2."""

# vitserve.engine.nothing_here is gone, and so is Wire v1; vllm/some/file.py is theirs.
X = "wire-v1 in a string is not prose"
'''
    found = [name for text in prose(gone) for name in missing_in_prose(text)]
    assert sorted(found) == sorted(
        [
            "vitserve/flags.py",
            "engine/adopt.py",
            "budgetx.py",
            "wire-v2",
            "Wire v1",
            "vitserve.engine.nothing_here",
        ]
    )
