"""The harness of the e2e tests (tests/e2e/live.py): a server whose start-up fails is reported at once."""

from __future__ import annotations

import pytest

from tests.e2e.live import cli_in_process, live_server


# Before: live_server waited its full 300 s start limit for a server whose thread had already returned 1,
# so a broken engine cost every test that used it five minutes. The timeout is far below that limit.
@pytest.mark.timeout(60)
def test_a_start_up_that_fails_is_raised_at_once_with_its_exit_code():
    with (
        pytest.raises(RuntimeError, match=r"ended during start-up: \{'code': 1\}"),
        live_server(llm_endpoint="tcp://256.0.0.1:x"),  # refused by the engine before any rank starts
    ):
        pytest.fail("the server started")


@pytest.mark.timeout(300)
def test_the_ranks_of_an_in_process_service_write_to_the_tests_stderr(tmp_path, capfd):
    """The ranks of an in-process service are forked from the session's forkserver, whose stdout and stderr
    are a pipe tests/conftest.py copies to this process's fd 2 as it comes: their phase lines reach the
    running test's capture (capfd) as the CLI process's reach its stderr. Without the copy they would go
    where the forkserver's stderr went when the session started, which no test reads."""
    argv = ["--model", "demo", "--port", "0", "--device", "cpu", "--visual_batch_max_tokens", "256"]
    argv += ["--visual_reserved_mem_gb", "0.25"]  # no start-up stress: its lines are not what this reads
    with cli_in_process(argv, tmp_path):
        pass
    err = capfd.readouterr().err
    assert "vitserve [group 0]" in err
    assert "loading weights: --model demo" in err
