"""Two vitserve replicas with --llm_transport ec_storage on one --ec_storage_path, in front of one real vLLM
encoder-cache consumer of that directory, under a byte bound that holds only a few files (docs/vllm.md): with
concurrent clients sending the same few images to both, each replica writes, reuses and evicts files the other
names in requests in flight. Every answer must be a 200 and vLLM must stay alive (a file removed before vLLM
reads it kills its engine). (tests/integration/test_ec_replicas.py checks the directory's bound.)

This module has its own Qwen2.5-VL consumer (tests/vllm/servers.py `replicas_consumer`, started early beside
the others) and two in-process vitserve services (tests/vllm/stack.py vitserve_in_process)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.openai_chat import chat_request, image_url_part
from tests.vllm import servers
from tests.vllm.ec_cases import BOUND_GB
from tests.vllm.stack import metric, png, vitserve_in_process

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
IMAGES = 10  # distinct images, ~12-16 KB of file each: ~4 fit in BOUND_GB, so the bound is always at work
CLIENTS = 4


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    ckpt, tmp, vllm = servers.take_more("replicas", tmp_path_factory.mktemp("replicas"))
    try:
        yield ckpt, tmp, vllm.wait_ready()
    finally:
        vllm.stop()


def _replica(ckpt, vllm, tmp, name):
    args = ("--llm_transport", "ec_storage", "--ec_storage_path", str(servers.ec_dir(tmp)))
    return vitserve_in_process(ckpt, vllm.url, tmp / name, *args, "--ec_storage_gb", str(BOUND_GB))


@pytest.mark.parametrize("requests", [200, pytest.param(2000, marks=pytest.mark.slow)])
def test_two_replicas_on_one_directory_answer_every_request_and_keep_vllm_alive(consumer, requests):
    ckpt, tmp, vllm = consumer
    images = [png(224, 224 - 28 * (i % 3), seed=100 + i) for i in range(IMAGES)]
    with _replica(ckpt, vllm, tmp, "one") as one, _replica(ckpt, vllm, tmp, "two") as two:
        urls = [one.url, two.url]
        rng = random.Random(7)
        plan = [(rng.choice(urls), rng.sample(range(IMAGES), 2)) for _ in range(requests)]

        def send(item: tuple[str, list[int]]) -> tuple[int, str]:
            url, picked = item
            body = {**chat_request(str(ckpt), image_url_part(images[picked[0]])), "max_tokens": 1}
            body["messages"][0]["content"].insert(1, image_url_part(images[picked[1]]))
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
            return r.status_code, r.text[:300]

        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(send, plan))
        failed = [a for a in answers if a[0] != 200]
        assert failed == [], f"{len(failed)} of {requests} failed, first: {failed[:3]}"
        assert vllm.alive()
        evicted = sum(metric(url, "vitserve_ec_evictions_total", reason="bytes") for url in urls)
        reused = sum(metric(url, "vitserve_ec_reuses_total") for url in urls)
        assert evicted > 0  # the bound was at work
        assert reused > 0  # and files were reused
