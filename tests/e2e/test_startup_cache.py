"""The reservation cache through the CLI's service (docs/engine.md, "Start-up"): a second start on the same
runtime dir with nothing changed skips the stress; a changed budget measures again and warns naming the
change. The mechanism, not the time: bench/startup.py measures the seconds. The service runs in this process
(tests/e2e/live.py cli_in_process); its ranks' phase lines and logs reach the test's capture through the
session forkserver's relay (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.e2e.live import cli_in_process
from tests.e2e.test_cli_process import BASE_ARGS

pytestmark = pytest.mark.timeout(300)


def _start(tmp_path, budget: int, capfd) -> str:
    """What one start wrote to stderr: the ranks' phase lines and logs, and the service's."""
    args = [*BASE_ARGS]
    args[args.index("--visual_batch_max_tokens") + 1] = str(budget)
    capfd.readouterr()  # only this start's output
    with cli_in_process(args, tmp_path):  # returns once every rank reported READY and the banner is out
        pass
    return capfd.readouterr().err


def _phases(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("vitserve [group 0]")]


def test_a_restart_reuses_the_reservation_and_a_changed_budget_measures_again(tmp_path, capfd):
    cold = _start(tmp_path, 64, capfd)
    assert "CPU stress: VmRSS" in cold  # measured
    phases = _phases(cold)
    assert any("loading weights" in line for line in phases)
    assert any("stress: full-budget batch 1/" in line and "ETA" in line for line in phases)
    assert any("publishing:" in line and "MiB reserved (full)" in line for line in phases)
    assert (tmp_path / "rt" / "reservation_cache_cpu_0.json").is_file()

    warm = _start(tmp_path, 64, capfd)
    assert "CPU stress: VmRSS" not in warm  # no stress ran
    assert any("stress: skipped" in line for line in _phases(warm))
    assert any("MiB reserved (stored)" in line for line in _phases(warm))

    changed = _start(tmp_path, 128, capfd)
    assert "CPU stress: VmRSS" in changed
    warning = [line for line in changed.splitlines() if "measured under another setup" in line]
    assert warning, changed[-3000:]
    assert "WARNING" in warning[0]
    assert "visual_batch_max_tokens 64 -> 128" in warning[0]
