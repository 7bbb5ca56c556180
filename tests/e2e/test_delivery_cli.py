"""Issue 13's "done when" for delivery, from outside with the real CLI (demo model) and receivers in their
own processes (docs/wire.md): with the receiver killed /encode does not answer 200, and a receiver that binds
the same endpoint afterwards never gets that request's embedding, while a new request reaches it at once."""

from __future__ import annotations

import shutil
import tempfile
import time

import httpx
import pytest

from tests.cli import Cli
from tests.e2e.live import noise_png
from tests.e2e.test_cli_process import BASE_ARGS, FAST_START, metric
from tests.receivers import ReceiverProcess

pytestmark = pytest.mark.timeout(300)
# --request_timeout_s: how long a request waits for the receiver's acknowledgement (the lost one waits it all)
TIMEOUT_S = 5


def _args(endpoint: str) -> list[str]:
    args = list(BASE_ARGS)
    args[args.index("--request_timeout_s") + 1] = str(TIMEOUT_S)
    return [*args, *FAST_START, "--llm_endpoint", endpoint]


def _encode(url: str, request_id: str, seed: int) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S + 30) as c:
        return c.post(
            "/encode",
            files=[("images", ("a.png", noise_png(64, 64, seed=seed)))],
            data={"request_id": request_id},
        )


def _wait_ready(url: str, want: int, limit_s: float = 60) -> None:
    end = time.monotonic() + limit_s
    while httpx.get(url + "/ready", timeout=10).status_code != want:
        assert time.monotonic() < end, f"/ready never answered {want}"
        time.sleep(0.05)


@pytest.fixture
def short_dir():
    path = tempfile.mkdtemp(prefix="vs-dlv-", dir="/tmp")  # ipc:// paths must fit in sun_path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_killed_receiver_no_200_and_its_successor_gets_only_new_work(tmp_path, short_dir):
    pytest.importorskip("vitserve.engine")
    endpoint = f"ipc://{short_dir}/llm.sock"
    first = ReceiverProcess(endpoint)
    srv = Cli(_args(endpoint), tmp_path)
    try:
        srv.wait_started()
        _wait_ready(srv.url, 200)  # ranks up and the receiver connected
        ok = _encode(srv.url, "before", 0)
        assert ok.status_code == 200, ok.text
        assert [img["delivered"] for img in ok.json()["images"]] == [True]
        assert [m["request_id"] for m in first.messages] == ["before"]

        first.kill()  # SIGKILL: no clean close
        _wait_ready(srv.url, 503)
        assert "--llm_endpoint" in httpx.get(srv.url + "/ready", timeout=10).json()["error"]["message"]
        lost = _encode(srv.url, "lost", 1)
        assert lost.status_code == 504, lost.text
        assert lost.json()["error"]["code"] == "llm_timeout"

        with ReceiverProcess(endpoint) as second:  # the same endpoint, after the request failed
            _wait_ready(srv.url, 200)
            start = time.monotonic()
            fresh = _encode(srv.url, "fresh", 2)
            took = time.monotonic() - start
            assert fresh.status_code == 200, fresh.text
            assert fresh.json()["images"][0]["delivered"] is True
            time.sleep(1.0)  # anything stale would have arrived by now
            assert [m["request_id"] for m in second.messages] == ["fresh"]
            assert second.stats.get("expired", 0) == 0  # "lost" never even reached its queue
        assert metric(srv.url, 'vitserve_llm_messages_total{outcome="delivered"}') == 2
        assert metric(srv.url, 'vitserve_llm_messages_total{outcome="llm_timeout"}') == 1
        print(f"new request through the restarted receiver: {took:.2f} s")
    finally:
        first.kill()
        srv.stop()
