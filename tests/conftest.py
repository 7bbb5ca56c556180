"""Shared fixtures. Tests are marked by folder: unit/, integration/, e2e/ (see pyproject markers)."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import settings

import tests.profiles  # noqa: F401  (registers the Hypothesis profiles)
from tests import parallel
from tests.vllm import servers

# Two cores here: keep each process to one intra-op thread unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.load_profile("quick")  # --hypothesis-profile slow, read after this, switches

_FOLDER_MARKS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration, "e2e": pytest.mark.e2e}
# Folders whose tests start encoder ranks from this process (in-process engines, gloo ranks); their
# tests get the session's forkserver (the `forkserver` fixture).
_RANK_FOLDERS = {"integration", "e2e"}
# Unit tests (no processes, no sockets) get a tighter limit than pyproject's default of 300 s: the slowest
# took 15.5 s (--durations, 2 cores at load ~19). A unit test that needs more marks its own timeout.
UNIT_TIMEOUT_S = 60


def pytest_configure(config):
    parallel.end_with_the_run(config)  # SIGTERM, SIGHUP, Ctrl-C: no server a test started outlives the run


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:  # a worker of `-n N`: the longest units first (tests/parallel.py)
        parallel.order(items)
    for item in items:
        folder = parallel.folder(item)
        mark = _FOLDER_MARKS.get(folder)
        if mark is not None:
            item.add_marker(mark)
        if folder == "unit" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent with -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with tests/parallel.py's units of work."""
    return parallel.Scheduling(config, log) if config.getvalue("dist") == "loadscope" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with parallel.turn(item):  # a `solo` test runs with no other test beside it
        return (yield)


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (tiny models: threads only add contention on 2 cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def forkserver() -> None:
    """The ranks' warm forkserver (vitserve/processes/zygote.py), started once for the session as the CLI starts
    it: every rank an in-process engine or tests/dist.py starts afterwards is forked with torch, zmq and the
    rank's modules already imported, instead of a spawned interpreter importing them again (~7 s of CPU on
    2 cores, for each of ~45 engine starts). It dies with the pytest process (processes/guard.py).

    A forked rank writes to the forkserver's stdout and stderr, not to this process's at the time it starts
    (as a spawned one did), so they are a pipe whose bytes a thread copies to this process's fd 2 as they
    come: rank output lands in the running test's captured output (capfd, failure reports)."""
    from vitserve.checkpoint import Checkpoint
    from vitserve.processes import zygote

    read_end, write_end = os.pipe()
    saved = os.dup(1), os.dup(2)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    try:
        zygote.start(Checkpoint.demo())  # the forkserver is launched here, inheriting fds 1 and 2 (the pipe)
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        os.close(write_end)
    threading.Thread(target=_relay, args=(read_end,), name="forkserver-output", daemon=True).start()


def _relay(read_end: int) -> None:
    while chunk := os.read(read_end, 1 << 16):  # b"" once the forkserver and every rank are gone
        os.write(2, chunk)


@pytest.fixture(autouse=True)
def _ranks_from_the_session_forkserver(request) -> None:
    if parallel.folder(request.node) in _RANK_FOLDERS:
        request.getfixturevalue("forkserver")


@pytest.fixture(scope="session", autouse=True)
def _vllms_start_while_the_other_tests_run(request, tmp_path_factory):
    """A serial run with tests/vllm after other tests starts its vLLMs when the run begins, one after another
    on a thread (tests/vllm/servers.py says why); what tests/vllm did not take is stopped when the run ends.
    Not under xdist (a worker does not know whether tests/vllm will be its), and not for a run that begins
    with tests/vllm: its first test would wait for all of them (`take` starts them at once instead)."""
    items = request.session.items
    vllm_first = next((i for i, item in enumerate(items) if parallel.folder(item) == "vllm"), None)
    if "PYTEST_XDIST_WORKER" not in os.environ and vllm_first:
        servers.start_in_background(tmp_path_factory.mktemp("vllm"))
    yield
    servers.stop_early()
