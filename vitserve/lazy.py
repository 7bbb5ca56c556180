"""Names of a package that load on first use (PEP 562), for the package `__init__`s that must stay cheap:
`import vitserve` imports no torch, and a video decoder process imports no transformers through
vitserve.processors or vitserve.video.

    _LAZY = {"Name": "package.module"}                # public name -> module that defines it
    __getattr__, __dir__ = lazy_names(__name__, _LAZY)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, loading each name of `table` when first
    read and keeping it in the package's namespace, so later look-ups never come back here."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
