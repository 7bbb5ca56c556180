"""vitserve --llm_transport ec_storage in front of a real vLLM encoder-cache consumer (docs/vllm.md): the cases
tests/vllm/test_front_door.py runs for each family, against the same vLLMs (tests/vllm/servers.py starts every
one as a consumer of `servers.ec_dir`), so they cost no vLLM start-up of their own.

Tokens must equal vLLM's own from the raw media and logprobs agree within 1e-4 (the tower runs in float32 here,
so the file holds what vLLM's own tower computes, up to the float round-off of another order); the bodies sent
upstream are read from vitserve's vitserve_upstream_body_bytes histogram, and the files from the directory
with the header check vitserve itself uses.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.openai_chat import assert_same_answer, chat_request, complete, image_url_part
from tests.vllm import servers
from tests.vllm.stack import Stack, metric, png, vitserve_in_process
from vitserve.handover.ec_files import FILE_NAME, check_file, is_uuid

BODY_LIMIT = 64 * 1024  # SPEC §10: at most this much goes upstream per request, whatever the images
# --ec_storage_gb of the vitserve these cases start: ~63 KiB, above any one file of these images (at most ~46 KB:
# Qwen3-VL's 64 x 3 floats per row) and below a few of them, so the bound is reached within a few requests
BOUND_GB = 0.00006


def ec_args(stack: Stack) -> tuple[str, ...]:
    path = str(servers.ec_dir(stack.tmp))
    return ("--llm_transport", "ec_storage", "--ec_storage_path", path, "--ec_storage_gb", str(BOUND_GB))


@pytest.fixture(scope="module")
def ec(stack):
    """vitserve with ec_storage in front of the family's vLLM consumer: the CLI's own service for these flags,
    run in this process (stack.vitserve_in_process: the stack's inline vitserve is the CLI process, and a
    start of the CLI costs 7-13 s here; what ec_storage adds lives in the app, not in the process)."""
    with vitserve_in_process(stack.ckpt, stack.vllm.url, stack.tmp / "ec-vs", *ec_args(stack)) as server:
        yield server


def _files(stack: Stack) -> dict[str, int]:
    """uuid -> bytes of every encoder-cache file in the directory."""
    root = servers.ec_dir(stack.tmp)
    return {p.parent.name: p.stat().st_size for p in root.glob(f"*/{FILE_NAME}")}


def _sent(url: str) -> tuple[float, float]:
    return metric(url, "vitserve_upstream_body_bytes_sum"), metric(url, "vitserve_upstream_body_bytes_count")


def _through(stack: Stack, url: str, body: dict) -> tuple[object, float]:
    """The answer through vitserve, and the bytes of the one body it sent upstream for it."""
    (bytes0, n0) = _sent(url)
    answer = complete(url, body)
    (bytes1, n1) = _sent(url)
    assert n1 == n0 + 1
    return answer, bytes1 - bytes0


def _assert_files_whole(stack: Stack) -> None:
    """Every file vitserve wrote is named by a uuid of its own and holds a whole tensor."""
    root = servers.ec_dir(stack.tmp)
    for uuid in _files(stack):
        assert is_uuid(uuid)
        info = check_file(root, uuid)
        assert info.metadata["producer"] == "vitserve"
        assert info.rows > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_ec_storage_one_image_equals_vllms_own(stack, ec, stream):
    body = chat_request(stack.model, image_url_part(png(301, 203, seed=21 + stream)), stream=stream)
    before = set(_files(stack))
    through, sent = _through(stack, ec.url, body)
    assert_same_answer(complete(stack.vllm.url, body), through)
    assert sent <= BODY_LIMIT
    assert len(set(_files(stack)) - before) == 1
    _assert_files_whole(stack)


def test_ec_storage_several_images_in_one_body_of_at_most_64_kib(stack, ec):
    body = chat_request(stack.model, image_url_part(png(112, 84, seed=22)))
    body["messages"][0]["content"][1:1] = [image_url_part(png(224, 168, seed=23 + i)) for i in range(3)]
    through, sent = _through(stack, ec.url, body)
    assert_same_answer(complete(stack.vllm.url, body), through)
    assert sent <= BODY_LIMIT
    _assert_files_whole(stack)


def test_ec_storage_a_video_equals_vllms_own_video_path(stack, ec, clip):
    from tests.vllm.test_front_door import RAW_VIDEO_TOL, VIDEO_SAMPLING, _video_url_part

    body = chat_request(stack.model, _video_url_part(clip))
    direct = complete(stack.vllm.url, {**body, "media_io_kwargs": {"video": {"num_frames": -1}}})
    through, sent = _through(stack, ec.url, {**body, "mm_processor_kwargs": VIDEO_SAMPLING})
    assert_same_answer(direct, through, tol=RAW_VIDEO_TOL)
    assert sent <= BODY_LIMIT


def test_ec_storage_a_repeated_image_reuses_its_file_and_encodes_nothing(stack, ec):
    body = chat_request(stack.model, image_url_part(png(160, 120, seed=24)))
    first = complete(ec.url, body)
    writes, reuses = metric(ec.url, "vitserve_ec_writes_total"), metric(ec.url, "vitserve_ec_reuses_total")
    # decoded images observe their tokens; the engine counts its cache hits: neither moves for a reuse
    work = [metric(ec.url, n) for n in ("vitserve_image_tokens_count", "vitserve_cache_hits_total")]
    second = complete(ec.url, body)
    assert metric(ec.url, "vitserve_ec_writes_total") == writes
    assert metric(ec.url, "vitserve_ec_reuses_total") == reuses + 1
    assert [metric(ec.url, n) for n in ("vitserve_image_tokens_count", "vitserve_cache_hits_total")] == work
    assert_same_answer(first, second, tol=0.0)


def test_ec_storage_a_broken_or_vanished_file_never_reaches_vllm(stack, ec):
    image = png(128, 96, seed=25)
    body = chat_request(stack.model, image_url_part(image))
    before = set(_files(stack))
    good = complete(ec.url, body)
    (uuid,) = set(_files(stack)) - before
    path = servers.ec_dir(stack.tmp) / uuid / FILE_NAME
    data = path.read_bytes()
    temp = path.with_name(".broken")
    temp.write_bytes(
        data[:-64]
    )  # a file cut short, put in place by rename (vLLM may have the old one mapped)
    os.replace(temp, path)
    upstream = metric(ec.url, "vitserve_upstream_requests_total")
    r = httpx.post(ec.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "ec_file_missing"
    assert metric(ec.url, "vitserve_upstream_requests_total") == upstream  # nothing went upstream
    assert stack.vllm.alive()
    path.unlink(missing_ok=True)  # vitserve forgot it; a request now writes it again
    assert_same_answer(good, complete(ec.url, body))
    assert path.is_file()
    assert stack.vllm.alive()


def test_ec_storage_refuses_a_clients_uuid(stack, ec):
    part = {**image_url_part(png(64, 64)), "uuid": "../../etc/passwd"}
    r = httpx.post(ec.url + "/v1/chat/completions", json=chat_request(stack.model, part), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].content[0]: a 'uuid' is not accepted")


def test_ec_storage_the_directory_stays_within_its_bound(stack, ec):
    bound = BOUND_GB * 2**30
    for seed in range(30, 50):
        body = chat_request(stack.model, image_url_part(png(224, 224, seed=seed)))
        complete(ec.url, {**body, "max_tokens": 1})
        held = metric(ec.url, "vitserve_ec_bytes")
        assert held <= bound
        if metric(ec.url, "vitserve_ec_evictions_total", reason="bytes") >= 3:
            break
    assert metric(ec.url, "vitserve_ec_evictions_total", reason="bytes") >= 3
    assert sum(_files(stack).values()) <= bound  # the directory itself, not only vitserve's count


@pytest.mark.parametrize("stack", ["qwen2_5_vl"], indirect=True)
def test_ec_storage_to_vllm_without_its_tower(stack, vllms):
    """Qwen2.5-VL's tower-less consumer ("bare") reads the same directory; Qwen3-VL keeps its tower (vLLM
    turns DeepStack off without it, docs/vllm.md)."""
    bare = vllms["bare"][2]
    if bare.stopped:  # the inline test of the bare server stops it at its end
        pytest.fail("the bare vLLM was stopped before the ec_storage case ran")
    bare.wait_ready()
    with vitserve_in_process(stack.ckpt, bare.url, stack.tmp / "ec-bare", *ec_args(stack)) as vitserve:
        for seed, stream in ((41, False), (42, True)):
            body = chat_request(stack.model, image_url_part(png(301, 203, seed=seed)), stream=stream)
            assert_same_answer(complete(stack.vllm.url, body), complete(vitserve.url, body))
        assert bare.alive()


@pytest.mark.parametrize("stack", ["qwen2_5_vl"], indirect=True)
def test_ec_storage_to_a_vllm_that_is_no_consumer_is_a_502_saying_how_to_start_it(stack, vllms):
    plain = vllms["plain"][2].wait_ready()
    path = Path(servers.ec_dir(stack.tmp))
    try:
        with vitserve_in_process(stack.ckpt, plain.url, stack.tmp / "ec-plain", *ec_args(stack)) as vitserve:
            body = chat_request(stack.model, image_url_part(png(64, 64, seed=43)))
            r = httpx.post(vitserve.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert error["code"] == "llm_not_ec_consumer"
            assert "--ec-transfer-config" in error["message"]
            assert "ec_consumer" in error["message"]
            assert plain.alive()
            assert path.is_dir()
    finally:
        plain.stop()


REPLICA_IMAGES = (
    10  # distinct images, ~12-16 KB of file each: ~4 fit in BOUND_GB, so the bound is always at work
)
REPLICA_CLIENTS = 4


@pytest.mark.parametrize("requests", [200, pytest.param(2000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stack", ["qwen2_5_vl"], indirect=True)
def test_ec_storage_two_replicas_on_one_directory_answer_every_request(stack, ec, requests):
    """Two more in-process replicas on the family consumer's directory (three with `ec`), under a bound that
    holds only a few files: with concurrent clients sending the same few images to both, each writes, reuses
    and evicts files the other names in requests in flight. Every answer is a 200 and vLLM stays alive (a file
    removed before vLLM reads it kills its engine). tests/integration/test_ec_replicas.py checks the bound."""
    images = [png(224, 224 - 28 * (i % 3), seed=100 + i) for i in range(REPLICA_IMAGES)]
    tmp, model = stack.tmp, stack.model
    args = ec_args(stack)
    with (
        vitserve_in_process(stack.ckpt, stack.vllm.url, tmp / "replica-1", *args) as one,
        vitserve_in_process(stack.ckpt, stack.vllm.url, tmp / "replica-2", *args) as two,
    ):
        urls = [one.url, two.url]
        rng = random.Random(7)
        plan = [(rng.choice(urls), rng.sample(range(REPLICA_IMAGES), 2)) for _ in range(requests)]

        def send(item: tuple[str, list[int]]) -> tuple[int, str]:
            url, picked = item
            body = {**chat_request(model, image_url_part(images[picked[0]])), "max_tokens": 1}
            body["messages"][0]["content"].insert(1, image_url_part(images[picked[1]]))
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
            return r.status_code, r.text[:300]

        with ThreadPoolExecutor(REPLICA_CLIENTS) as pool:
            answers = list(pool.map(send, plan))
        failed = [a for a in answers if a[0] != 200]
        assert failed == [], f"{len(failed)} of {requests} failed, first: {failed[:3]}"
        assert stack.vllm.alive()
        evicted = sum(metric(url, "vitserve_ec_evictions_total", reason="bytes") for url in urls)
        reused = sum(metric(url, "vitserve_ec_reuses_total") for url in urls)
        assert evicted > 0  # the bound was at work
        assert reused > 0  # and files were reused
