"""The harness of the e2e tests (tests/e2e/live.py): a server whose start-up fails is reported at once."""

from __future__ import annotations

import pytest

from tests.e2e.live import live_server


# Before: live_server waited its full 300 s start limit for a server whose thread had already returned 1,
# so a broken engine cost every test that used it five minutes. The timeout is far below that limit.
@pytest.mark.timeout(60)
def test_a_start_up_that_fails_is_raised_at_once_with_its_exit_code():
    with (
        pytest.raises(RuntimeError, match=r"ended during start-up: \{'code': 1\}"),
        live_server(llm_endpoint="tcp://256.0.0.1:x"),  # refused by the engine before any rank starts
    ):
        pytest.fail("the server started")
