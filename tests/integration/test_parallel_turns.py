"""tests/parallel.py `turn`: the readers-writer lock that runs a `solo` test alone, between real processes
(tests/unit/test_parallel.py holds the units of work)."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import time
from pathlib import Path

from tests.unit.test_parallel import _take_turn


def _wait_until_the_gate_is_held(folder: Path) -> None:
    with open(folder / "turn.gate", "a") as gate:
        for _ in range(6000):
            try:
                fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(gate, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError("the solo test never took the gate")


def test_a_solo_test_waits_for_the_running_tests_and_holds_back_new_ones(tmp_path, monkeypatch):
    """Shared holders run together; a solo one enters only once they left, and a shared one that comes
    while the solo one waits or runs enters only after it (events between real processes, no sleeps)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    ctx = mp.get_context("fork")
    entered = {name: ctx.Event() for name in ("a", "b", "solo", "late")}
    leave = {name: ctx.Event() for name in entered}

    def start(name: str, solo: bool):
        proc = ctx.Process(target=_take_turn, args=(tmp_path, solo, entered[name], leave[name]))
        proc.start()
        return proc

    procs = [start("a", False), start("b", False)]
    assert entered["a"].wait(60)
    assert entered["b"].wait(60)  # two shared holders at once
    procs.append(start("solo", True))
    _wait_until_the_gate_is_held(tmp_path)  # the solo test waits at the room's door, holding the gate
    assert not entered["solo"].is_set()  # a and b are still inside
    procs.append(start("late", False))
    leave["a"].set()
    leave["b"].set()
    assert entered["solo"].wait(60)
    assert not entered["late"].is_set()  # never beside the solo test
    leave["solo"].set()
    assert entered["late"].wait(60)
    leave["late"].set()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
