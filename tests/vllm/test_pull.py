"""vitserve --llm_transport pull in front of a real vLLM that runs vitserve's own encoder-cache connector
(docs/vllm.md, "Pull"): the session's one connector vLLM (tests/vllm/connector_server.py, `connector_vllm`: Qwen3-VL,
a key file, a small bound, wait_s 3 s), shared with tests/vllm/test_wire.py and test_connector.py: no vLLM
start-up of its own. Its extra config names no `pull_from`, so its connector fetches from this host's producers
only, with its key: vitserve binds its producer on loopback with the same --wire_key_file.

Tokens must equal vLLM's own from the raw image (logprobs within 1e-4); what the connector fetched is read from
its own counters in vLLM's /metrics (a fetched item is `received` as a push is, then `supplied`; the fetcher's
own: `pull_*`).

Behind nginx: the Qwen2.5-VL connector vLLM and the data-parallel one (two engine cores; tests/vllm/servers.py
`connector_dp`), whose cores also take pushes pinned to them (`dp_push`): vitserve --llm_transport wire
--llm_dp_size 2 against it is the push half of "data parallelism through vitserve", pull the other.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import queue
import signal
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cli import Cli
from tests.nginx_server import NginxServer
from tests.openai_chat import assert_same_answer, chat_request, complete, image_url_part
from tests.ports import unused_port
from tests.vllm.connector_server import ConnectorVllm, start_glue
from tests.vllm.stack import cli_args, metric, png, vitserve_in_process

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
RECEIVED = "vllm:vitserve_connector_received_total"
PULLED = "vllm:vitserve_connector_pull_kept_total"
PULLED_BYTES = "vllm:vitserve_connector_pull_bytes_total"
ADOPTED = "vllm:vitserve_connector_adopted_total"  # files vitserve wrote into the connector's shared memory
IDLE_WAITS = "vllm:vitserve_connector_pull_idle_waits_total"
PULLED_MS = "vllm:vitserve_connector_pull_ms_total"  # may stay 0: a fetch can take under 0.5 ms


@pytest.fixture(scope="module")
def consumer(connector_vllm) -> ConnectorVllm:
    connector_vllm.server.wait_ready()
    return connector_vllm


def _vitserve(consumer: ConnectorVllm, name: str):
    bind = f"tcp://127.0.0.1:{unused_port()}"
    args = ("--llm_transport", "pull", "--pull_bind", bind, "--wire_key_file", str(consumer.key_file))
    return vitserve_in_process(consumer.ckpt, consumer.server.url, consumer.ckpt.parent / name, *args)


@pytest.fixture(scope="module")
def pull(consumer):
    with _vitserve(consumer, "pull-vs") as server:
        yield server


def test_pull_one_image_equals_vllms_own(consumer, pull):
    vllm = consumer.server
    body = chat_request(str(consumer.ckpt), image_url_part(png(96, 64, seed=81)))
    names = (RECEIVED, PULLED, PULLED_BYTES, ADOPTED, IDLE_WAITS)
    before = [metric(vllm.url, name) for name in names]
    through = complete(pull.url, body)
    received, pulled, pulled_bytes, adopted, idle_waits = (
        metric(vllm.url, n) - b for n, b in zip(names, before, strict=True)
    )
    assert (received, pulled) == (1, 1)  # fetched from vitserve, not encoded by vLLM
    assert pulled_bytes > 0
    assert adopted == 1  # one host: vitserve wrote it into the connector's area, no bytes through the socket
    assert idle_waits == 1  # nothing else ran: the scheduler waited for the fetch in place, no empty step
    assert PULLED_MS in httpx.get(vllm.url + "/metrics", timeout=10, trust_env=False).text
    assert_same_answer(complete(vllm.url, body), through)


def test_pull_two_replicas_at_once_every_answer_is_vllms_own(consumer, pull):
    ckpt, vllm = consumer.ckpt, consumer.server
    bodies = [chat_request(str(ckpt), image_url_part(png(64 + 16 * i, 64, seed=82 + i))) for i in range(4)]
    expected = [complete(vllm.url, b) for b in bodies]
    with _vitserve(consumer, "pull-2") as second, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, [pull.url, second.url] * 2, bodies))
    for want, got in zip(expected, answers, strict=True):
        assert_same_answer(want, got)
    assert vllm.alive()


def _width(consumer: ConnectorVllm) -> int:
    config = json.loads((consumer.ckpt / "config.json").read_text())
    levels = len(config["vision_config"].get("deepstack_visual_indexes") or [])
    return int(config["text_config"]["hidden_size"]) * (1 + levels)


@pytest.mark.parametrize(
    ("producer", "why"),
    [("tcp://10.9.9.9:5700", "not admitted"), (None, "not held"), ("dead", "refuses connections")],
    ids=["outside-pull_from", "missing", "replica-gone"],
)
def test_pull_an_item_that_cannot_be_fetched_fails_that_request_alone(consumer, pull, producer, why):
    """Straight to vLLM: an announced item whose producer is outside pull_from (refused at once, no network), a
    producer that does not hold it (vitserve's own, asked for a uuid it never kept), or a replica that is gone
    (nothing listens: the fetch fails when the connection is refused, not at wait_s): vLLM fails that request
    and serves the next one."""
    vllm = consumer.server
    info = httpx.get(pull.url + "/v1/info", timeout=10).json()
    if producer == "dead":  # a replica that was killed: nothing listens at its address
        producer = f"tcp://127.0.0.1:{unused_port()}"
    producer = producer or info["pull_advertise"]
    uuid = {"not admitted": "a", "not held": "b"}.get(why, "c") * 64
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": uuid}
    body = chat_request(str(consumer.ckpt), part)
    item = {"rows": 4, "width": _width(consumer), "dtype": "float32", "producer": producer}
    body["ec_transfer_params"] = {"vitserve": {"v": 1, "items": {uuid: item}}}
    r = httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 500, r.text
    assert vllm.alive()
    assert vllm.log_path.read_text(errors="replace").count(uuid) >= 1
    assert why in vllm.log_path.read_text(errors="replace")
    good = chat_request(str(consumer.ckpt), image_url_part(png(64, 64, seed=90)))
    assert_same_answer(complete(vllm.url, good), complete(pull.url, good))


# ------------------------------------------- two vLLMs behind nginx, one of them with two data-parallel cores


@pytest.fixture(scope="module")
def balanced(connector_qwen2_5_vl, connector_dp, tmp_path_factory):
    """nginx round robin over the Qwen2.5-VL connector vLLM and the data-parallel one (both push and pull), and
    two vitserve replicas pulling, both with nginx as --llm_url."""
    one, dp = connector_qwen2_5_vl, connector_dp
    assert one.ckpt == dp.ckpt, "one checkpoint: the same weights and model name behind the balancer"
    tmp = tmp_path_factory.mktemp("pull-balanced")
    nginx = NginxServer(
        tmp / "nginx", [f"127.0.0.1:{one.server.port}", f"127.0.0.1:{dp.server.port}"]
    ).start()
    try:
        replicas = []
        with contextlib.ExitStack() as stack:
            for name in ("r0", "r1"):
                bind = f"tcp://127.0.0.1:{unused_port()}"
                args = ("--llm_transport", "pull", "--pull_bind", bind, "--wire_key_file", str(one.key_file))
                replicas.append(
                    stack.enter_context(vitserve_in_process(one.ckpt, nginx.url, tmp / name, *args))
                )
            yield one, dp, nginx, replicas
    finally:
        nginx.stop()


def test_pull_behind_a_balancer_and_data_parallel_cores_every_answer_is_vllms_own(balanced):
    one, dp, nginx, replicas = balanced
    bodies = [
        chat_request(str(one.ckpt), image_url_part(png(64 + 16 * (i % 4), 64, seed=100 + i)))
        for i in range(8)
    ]
    expected = [complete(one.server.url, b) for b in bodies]  # vLLM's own tower on the raw image
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, [r.url for r in replicas] * 4, bodies))
    for want, got in zip(expected, answers, strict=True):
        assert_same_answer(want, got)
    served = {tries[-1] for tries in nginx.upstreams()[-8:]}
    assert served == {f"127.0.0.1:{one.server.port}", f"127.0.0.1:{dp.server.port}"}, "both engines served"
    per_core = [metric(dp.server.url, RECEIVED, engine=str(i)) for i in (0, 1)]
    assert all(n > 0 for n in per_core), f"both data-parallel cores fetched: {per_core}"
    assert one.server.alive()
    assert dp.server.alive()


def test_push_to_data_parallel_cores_pins_each_request_to_the_core_it_pushed_to(connector_dp):
    """vitserve --llm_transport wire --llm_dp_size 2: each request's embeddings go to one core's connector (its
    endpoint's port + the rank) and the request to that core (X-data-parallel-rank), keyed by a tag per message
    (--wire_security tag, as the cores' wire_security: each core's connector opens every push's tag). vLLM's own answer is asked
    before each: its balancer then turns to the other core, so a request that vitserve did not pin would land on
    the core without its embeddings and fail (after wait_s)."""
    dp = connector_dp
    vllm = dp.server
    args = (
        "--llm_transport",
        "wire",
        "--llm_endpoint",
        dp.endpoint,
        "--llm_dp_size",
        "2",
        "--wire_security",
        "tag",
    )
    bodies = [
        chat_request(str(dp.ckpt), image_url_part(png(64 + 16 * i, 80, seed=130 + i))) for i in range(4)
    ]
    before = [metric(vllm.url, RECEIVED, engine=str(i)) for i in (0, 1)]
    with vitserve_in_process(
        dp.ckpt, vllm.url, dp.ckpt.parent / "push-dp", *args, "--wire_key_file", str(dp.key_file)
    ) as push:  # ready: both cores' connectors are connected
        for body in bodies:
            want = complete(vllm.url, body)
            assert_same_answer(want, complete(push.url, body))
    per_core = [metric(vllm.url, RECEIVED, engine=str(i)) - before[i] for i in (0, 1)]
    assert per_core == [2, 2], f"each core received the pushes of the requests pinned to it: {per_core}"
    assert vllm.alive()


class _Holding:
    """An HTTP server that takes chat requests and answers none: the way from a replica to the balancer, on which
    its request is still travelling when the replica dies. `taken` has each request's body."""

    def __init__(self) -> None:
        self.taken: queue.Queue[bytes] = queue.Queue()
        self.done = threading.Event()
        holding = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                holding.taken.put(self.rfile.read(int(self.headers["content-length"])))
                holding.done.wait(300)
                with contextlib.suppress(OSError):
                    self.send_error(503)

            def log_message(self, *args: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.done.set()
        self.server.shutdown()
        self.server.server_close()


def test_pull_a_replica_killed_between_its_chat_request_and_the_pull_fails_its_requests_alone(
    balanced, tmp_path
):
    """A third replica (the real CLI, a process of its own) sends its chat request on and is killed (SIGKILL, its
    ranks too) before any engine fetches: that request, arriving at either engine, fails at once (the producer
    refuses connections, not a wait_s timeout) with vLLM's log naming the producer; the replica's client gets a
    broken connection; the replicas that live answer every request as vLLM would; both engines stay healthy and
    serve. The request is held on its way (`_Holding`) so "between the chat request and the pull" is certain."""
    one, dp, nginx, replicas = balanced
    holding = _Holding()
    bind = f"tcp://127.0.0.1:{unused_port()}"
    args = ("--llm_transport", "pull", "--pull_bind", bind, "--wire_key_file", str(one.key_file))
    doomed = Cli(cli_args(one.ckpt, holding.url, *args), tmp_path, session=True)
    try:
        doomed.wait_ready(300)
        lost_body = chat_request(str(one.ckpt), image_url_part(png(72, 88, seed=140)))
        bodies = [
            chat_request(str(one.ckpt), image_url_part(png(64 + 16 * i, 72, seed=141 + i))) for i in range(4)
        ]
        expected = [complete(one.server.url, b) for b in bodies]
        with ThreadPoolExecutor(5) as pool:
            lost = pool.submit(httpx.post, doomed.url + "/v1/chat/completions", json=lost_body, timeout=120)
            upstream = holding.taken.get(
                timeout=120
            )  # its embedding is kept in the replica; the request upstream
            doomed.signal_all(signal.SIGKILL)
            doomed.proc.wait(60)
            answers = list(pool.map(complete, [r.url for r in replicas] * 2, bodies))
            with pytest.raises(httpx.TransportError):
                lost.result()
        for want, got in zip(expected, answers, strict=True):
            assert_same_answer(want, got)
        ((uuid, item),) = json.loads(upstream)["ec_transfer_params"]["vitserve"]["items"].items()
        assert item["producer"] == bind
        for engine in (one.server, dp.server):  # the request the replica sent, reaching each engine now
            r = httpx.post(
                engine.url + "/v1/chat/completions",
                content=upstream,
                headers={"content-type": "application/json"},
                timeout=120,
            )
            assert r.status_code == 500, r.text
            log = engine.log_path.read_text(errors="replace")
            assert f"item {uuid}: fetching it from producer {bind} failed: {bind} refuses connections" in log
            assert engine.alive()
        good = chat_request(str(one.ckpt), image_url_part(png(64, 64, seed=150)))
        assert_same_answer(complete(one.server.url, good), complete(nginx.url, good))
        assert_same_answer(complete(dp.server.url, good), complete(nginx.url, good))
    finally:
        holding.close()
        doomed.stop()


CORES = textwrap.dedent(
    """
    import sys, types
    import vitserve.vllm_connector as module
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    def config(extra, index, local):
        ec = types.SimpleNamespace(ec_connector_extra_config=extra, is_ec_producer=False, is_ec_consumer=True)
        model = types.SimpleNamespace(
            dtype="float32", hf_config=types.SimpleNamespace(vision_config=None), get_hidden_size=lambda: 64
        )
        parallel = types.SimpleNamespace(data_parallel_index=index, data_parallel_rank_local=local)
        return types.SimpleNamespace(ec_transfer_config=ec, model_config=model, parallel_config=parallel)

    extra = {"endpoint": sys.argv[2], "shm_dir": sys.argv[1]}
    for name, more, index, local in [
        ("one-endpoint", {}, 1, 1), ("multi-node", {"dp_push": True}, 2, 0), ("pinned", {"dp_push": True}, 1, 1)
    ]:
        try:
            connector = module.VitserveECConnector(config({**extra, **more}, index, local), ECConnectorRole.SCHEDULER)
        except ValueError as exc:
            print(name, "REFUSED", exc, flush=True)
        else:
            print(name, "BOUND", connector.store.endpoint, flush=True)
            connector.shutdown()
    """
)


def test_a_data_parallel_core_the_connector_cannot_serve_by_push_is_refused_at_its_start(tmp_path):
    """The glue's own start (as vLLM's engine core runs it, in a fresh interpreter of vLLM's venv, vitserve's
    package alone on its path; not a whole vLLM start-up) for engine core 1 of a vLLM given one push endpoint,
    core 2 of a multi-node one (the first core of its node), and core 1 with dp_push: the first two refuse to
    start saying what to use instead, the third binds the port + 1."""
    port = unused_port()
    out = start_glue(tmp_path, CORES, f"tcp://127.0.0.1:{port - 1}")
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said["one-endpoint"].startswith("REFUSED this vLLM runs data-parallel engine cores (this is #1)")
    assert "--llm_transport pull" in said["one-endpoint"]
    assert "dp_push" in said["one-endpoint"]
    assert "--llm_dp_size" in said["one-endpoint"]
    assert said["multi-node"].startswith(
        "REFUSED this vLLM runs data-parallel engine cores on more than one node"
    )
    assert "--llm_transport pull" in said["multi-node"]
    assert said["pinned"] == f"BOUND tcp://127.0.0.1:{port}"
