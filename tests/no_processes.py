"""The rule that keeps tests/unit quick: a unit test starts no process (no interpreter, engine, server or rank).

`bash scripts/test.sh --quick` runs tests/unit, less its `heavy` tests, as the quick tier (README
"Development"); a test that needs a process belongs in tests/integration or tests/e2e. `guard` is active
around each tests/unit test's setup, call and teardown (tests/unit/conftest.py); a process started then fails
the test with `ProcessInUnitTest`, a BaseException so that no `except Exception` in the code under test
swallows it.
`allowed()` lifts it for the session fixture that starts tests/vllm's servers early in a serial run.

Caught, in the thread that runs the test: subprocess (run, Popen, check_output), os.system, os.posix_spawn*,
os.fork, and every multiprocessing start method (fork, forkserver, spawn: they go through `BaseProcess.start`).
Allowed (ALLOWED_PROGRAMS): `git`, which tests/unit/test_docs.py asks for the file list, and `ldconfig`, which
ctypes.util.find_library runs when a library (torch, glibc's malloc checks) looks for a shared object.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Programs a unit test may run: each is a short-lived tool, not an interpreter, server or rank.
ALLOWED_PROGRAMS = {"git", "ldconfig"}


class ProcessInUnitTest(BaseException):
    """A tests/unit test started a process: move it to tests/integration or tests/e2e."""


_active = False  # set while a unit test runs, for the thread that runs it (the main thread)
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _program(args: Any) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    name = os.fsdecode(first)
    return Path(name.split()[0] if isinstance(args, (str, bytes)) else name).name


def _refuse(what: str) -> None:
    # Only the test's own thread: a thread an earlier integration test left behind (a server's, a pool's) may
    # start a process while a unit test runs in a full serial run, and that is not the unit test's doing.
    if _active and threading.current_thread() is threading.main_thread():
        raise ProcessInUnitTest(
            f"a tests/unit test started a process ({what}); tests/unit is the quick tier "
            "(scripts/test.sh --quick): move the test to tests/integration or tests/e2e (tests/no_processes.py)"
        )


def _popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    if _program(args) not in ALLOWED_PROGRAMS:
        _refuse(f"subprocess {args!r:.200}")
    _ORIGINALS[subprocess.Popen, "__init__"](self, args, *rest, **kwargs)


def _wrap(owner: Any, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)
    _ORIGINALS[owner, name] = original

    def refusing(*args: Any, **kwargs: Any) -> Any:
        _refuse(f"{getattr(owner, '__name__', owner)}.{name}")
        return original(*args, **kwargs)

    setattr(owner, name, refusing)


def install() -> None:
    """Patch the process-starting calls once per pytest process (a no-op while no unit test runs)."""
    if _ORIGINALS:
        return
    _ORIGINALS[subprocess.Popen, "__init__"] = subprocess.Popen.__init__
    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]
    _wrap(multiprocessing.process.BaseProcess, "start")
    _wrap(multiprocessing.util, "spawnv_passfds")  # a forkserver or resource tracker started directly
    for name in ("fork", "system", "posix_spawn", "posix_spawnp", "forkpty"):
        if hasattr(os, name):
            _wrap(os, name)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    global _active
    _active = True
    try:
        yield
    finally:
        _active = False  # set while a unit test runs, for the thread that runs it (the main thread)


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    global _active
    was, _active = _active, False
    try:
        yield
    finally:
        _active = was
