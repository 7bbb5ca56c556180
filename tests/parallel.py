"""How the suite shares the machine between pytest-xdist workers (`-n 2 --dist loadscope --no-loadscope-reorder`).

Measured on 2 cores (bench/RESULTS.md, "The test suite"): serial, the suite used 52-68% of them (start-ups of subprocesses,
waits on servers); workers keep both busy (91-95%), which makes the run CPU-bound: two workers were the faster
of two and three, ~1.15x over serial. What the workers must not do, and how it is prevented here:

- start one expensive fixture several times. A session fixture runs once per worker; a module fixture once
  per worker that runs a test of its module. So `Scheduling` hands out work in units (`unit_of`): every
  test under tests/vllm is one unit (each real vLLM starts once, on one worker: a vLLM server is the suite's
  largest memory user, ~3 GiB each), the blocks of one document in tests/integration/test_doc_blocks.py are one (they
  share its server), a module that defines a module-, class- or package-scoped fixture is one, and any other
  test is a unit of its own. (xdist's `--dist loadgroup` would read `xdist_group` marks, but with pytest 9.2
  its renaming of the node ids has no effect: xdist 3.8 sets `item._nodeid`, which pytest no longer reads.)
- leave the longest unit for last. Units are handed out in collection order (--no-loadscope-reorder), which
  `order` sorts longest first: tests/vllm (minutes of vLLM start-ups), then the process-starting folders,
  then the unit tests, whose short tests fill the end; then the `solo` tests.
- run a timing-sensitive test beside a busy neighbour. A test marked `solo` (e.g. "every process is gone
  within 5 s of SIGTERM", a contract with Docker's stop timeout) runs while no other test runs: `turn` is a
  readers-writer lock between the workers, shared for every other test, exclusive for a solo one. Its limit
  stays what it says; only its neighbours wait.
- outlive the run. A process that runs tests ends the processes it started (servers in sessions of their own,
  which no signal to pytest's group reaches) when it is told to stop: `end_with_the_run` makes SIGTERM and
  SIGHUP act as Ctrl-C does (pytest's KeyboardInterrupt: fixtures tear down), after a SIGTERM to each child's
  group first, and a worker gets that SIGTERM when the controller dies (PR_SET_PDEATHSIG), which is how a
  SIGTERM or SIGKILL to the controller alone reaches it. xdist kills a worker 10 s after Ctrl-C; its children
  got their SIGTERM before, so none is left behind.

With `-n 0` (or `-p no:xdist`) none of this applies and the tests run one after another as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parent.parent
# The folders in the order their units are handed out (see `order`); a folder not named goes last.
FOLDER_ORDER = ("vllm", "e2e", "integration", "unit")
DOC_BLOCKS = "tests/integration/test_doc_blocks.py"
_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](module|class|package)["']""")


@functools.cache
def _defines_a_shared_fixture(path: str) -> bool:
    """The module defines a fixture that its tests share (read from its source: the controller process,
    which schedules, collects no tests and has no fixture objects to ask)."""
    try:
        return bool(_SHARED_SCOPE.search((ROOT / path).read_text()))
    except OSError:
        return False


def unit_of(nodeid: str) -> str:
    """The unit of work `nodeid` belongs to: tests of one unit run on one worker, in collection order."""
    path, _, rest = nodeid.partition("::")
    if path.startswith("tests/vllm/"):
        return "tests/vllm"
    if path == DOC_BLOCKS and "[" in rest:  # test_doc_block[docs/vllm.md:40]: its document
        return f"{path}::{rest.split('[', 1)[1].rsplit(':', 1)[0]}"
    if _defines_a_shared_fixture(path):
        return path
    return nodeid


class Scheduling(LoadScopeScheduling):
    """xdist's loadscope, with `unit_of` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


def folder(node: pytest.Item | pytest.Collector) -> str:
    """The folder a test (or its module) is in: unit, integration, e2e, vllm."""
    return Path(str(node.fspath)).parent.name


def order(items: list[pytest.Item]) -> None:
    """Sort by folder (FOLDER_ORDER), keeping the collection order inside each folder (a stable sort); the
    `solo` tests last, one after another: handed out among the others, each would wait for its neighbours'
    running tests (a vLLM start-up among them) while every worker idles behind it."""
    rank = {folder: i for i, folder in enumerate(FOLDER_ORDER)}
    items.sort(key=lambda item: (_is_solo(item), rank.get(folder(item), len(rank))))


def _is_solo(item: pytest.Item) -> bool:
    return item.get_closest_marker("solo") is not None


def _lock_dir(config: pytest.Config) -> Path | None:
    """The run's temp directory that every worker shares (xdist gives each worker `<run dir>/gwN`)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def turn(item: pytest.Item) -> Iterator[None]:
    """Hold the run's readers-writer lock for the test's setup, call and teardown: exclusive for a `solo`
    test, shared for any other. The gate makes a waiting solo test block newcomers, so the shared holders
    drain and it gets its turn (a plain shared/exclusive flock would let them overtake it forever)."""
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    solo = _is_solo(item)
    with open(folder / "turn.gate", "a") as gate, open(folder / "turn.room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


def end_with_the_run(config: pytest.Config) -> None:
    """In a process that runs tests (serial, or an xdist worker; not the controller): SIGTERM, SIGHUP and
    SIGINT end the children's groups, then raise KeyboardInterrupt; a worker gets SIGTERM when its controller
    dies."""
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        return  # the controller: it runs no test, and its workers follow it (below)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _stop)
    if "PYTEST_XDIST_WORKER" in os.environ:
        import ctypes

        from vitserve.processes.guard import PR_SET_PDEATHSIG

        controller = os.getppid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != controller:  # it died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


_stopping: list[int] = []  # the signals received: the first one stops the run, later ones must not interrupt
# its teardown (not SIG_IGN: a process started during the teardown would inherit it through exec)


def _stop(signum: int, frame: FrameType | None) -> None:
    _stopping.append(signum)
    if len(_stopping) > 1:
        return
    end_children()
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def end_children() -> None:
    """SIGTERM to every child of this process: to its whole group when it leads one (a server started with
    start_new_session, its ranks or engine core with it), else to the child alone (it shares pytest's group,
    which holds the controller and the shell that started it)."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(stat.parent.name)
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != me:  # field 4: the parent's pid
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGTERM)
