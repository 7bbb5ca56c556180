"""--cache_gb through HTTP: the real API and the real Engine (spawned rank, FakeEncoder on the real
qwen2_5_vl processor's patches) report `cached: true` for a repeated image, with the same embedding,
and count it in /metrics."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.e2e.live import live_server, noise_png
from tests.fakes import FakeEncoderFactory
from vitserve.client import VitserveClient
from vitserve.engine import Engine
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache-http")
    processor = load_image_processor("qwen2_5_vl", budget_tokens=256)

    def make_engine(config, metrics):
        return Engine(config, metrics, encoder_factory=FakeEncoderFactory(), environ={})

    with live_server(
        processor=processor,
        make_engine=make_engine,
        cache_gb=0.01,
        device="cpu",
        heartbeat_s=1.0,
        dist_timeout_s=10.0,
        runtime_dir=str(tmp / "runtime"),
    ) as srv:
        yield srv


def test_a_repeated_image_is_served_from_the_cache(server):
    a, b = noise_png(90, 60, seed=1), noise_png(60, 90, seed=2)
    with VitserveClient(server.url) as c:
        first = c.encode([a], return_embeddings=True, request_id="first")["images"]
        second = c.encode([b, a, b], return_embeddings=True, request_id="second")["images"]
    assert [i["cached"] for i in first] == [False]
    assert [i["cached"] for i in second] == [False, True, True]  # a from the cache; b shared with index 0
    assert second[1]["image_id"] == first[0]["image_id"] == hashlib.sha256(a).hexdigest()
    assert second[1]["num_tokens"] == first[0]["num_tokens"]
    # exact by construction: a cache hit / a shared in-flight encode returns the stored tensor's bytes
    assert torch.equal(second[1]["embedding"], first[0]["embedding"])
    assert torch.equal(second[2]["embedding"], second[0]["embedding"])
    with server.client() as h:
        text = h.get("/metrics").text
    assert 'vitserve_cache_hits_total{layer="local"} 1.0' in text
    assert 'vitserve_images_total{outcome="cached"} 2.0' in text
    assert 'vitserve_images_total{outcome="encoded"} 2.0' in text
    assert server.engine.jobs.fingerprint  # set from the ranks' model info and the processor clamp
