"""docs/design.md invariant 14: schemathesis generates requests from /openapi.json against a real server; nothing may answer 5xx."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.e2e.live import live_server

schemathesis = pytest.importorskip("schemathesis")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def live():
    with live_server(max_request_bytes=1024 * 1024) as srv:
        yield srv


def test_no_server_errors(live):
    from hypothesis import given

    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/encode" for op in operations)
    for op in operations:
        examples = 150 if op.path == "/encode" else 10

        @given(case=op.as_strategy())
        @settings(
            max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def run(case):
            resp = case.call(timeout=60)
            assert resp.status_code < 500, (case.method, case.path, resp.status_code, resp.text[:300])
            if resp.status_code >= 400 and "json" in str(resp.headers.get("content-type")):
                assert set(resp.json()) == {"error"}

        run()
    with live.client() as c:  # still serving normally
        assert c.get("/ready").status_code == 200
