"""issue 15, "done when": two vitserve replicas (real CLI processes, --model demo) with one real
Redis-protocol server. An image encoded on A is a hit on B: B encodes nothing (its /metrics say so) and
the embedding's bytes are identical. Killing Redis mid-run fails no request. The password (given to A by
flag, to B through VITSERVE_CACHE_URL) shows in neither replica's output."""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cli import Cli
from tests.e2e.live import noise_png
from tests.e2e.test_cli_process import BASE_ARGS, FAST_START
from tests.redis_server import redis_server
from vitserve.client import VitserveClient

pytestmark = pytest.mark.timeout(300)
PASSWORD = "s3cret-for-the-test"


def replica(tmp_path, args: list[str], env: dict[str, str]) -> Cli:
    return Cli([*BASE_ARGS, *FAST_START, "--cache_gb", "0.1", *args], tmp_path, extra_env=env)


def metric(replica: Cli, sample: str) -> float:
    with VitserveClient(replica.url) as c:
        text = c._http.get("/metrics").text
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def stop(replica: Cli) -> str:
    """SIGTERM, SIGKILL if it outlives 30 s; its whole output."""
    with contextlib.suppress(AssertionError):  # killed after 30 s: the output is what is checked
        replica.terminate(30)
    return replica.wait_exit(30)


def encode(url: str, images: list[bytes], rid: str) -> list[dict]:
    with VitserveClient(url, timeout=240) as c:
        return c.encode(images, return_embeddings=True, request_id=rid)["images"]


def test_two_replicas_share_one_redis_and_survive_its_death(tmp_path):
    with redis_server(tmp_path / "redis", password=PASSWORD) as server:
        a = replica(tmp_path / "a", ["--cache_url", server.url], {})
        b = replica(tmp_path / "b", [], {"VITSERVE_CACHE_URL": server.url})
        try:
            a.wait_started()
            b.wait_started()
            img = noise_png(96, 64, seed=11)
            (on_a,) = encode(a.url, [img], "on-a")
            (on_b,) = encode(b.url, [img], "on-b")
            assert (on_a["cached"], on_b["cached"]) == (False, True)
            assert on_b["image_id"] == on_a["image_id"]
            ea, eb = on_a["embedding"], on_b["embedding"]
            assert (ea.dtype, ea.shape) == (eb.dtype, eb.shape)
            assert eb.view(torch.uint8).numpy().tobytes() == ea.view(torch.uint8).numpy().tobytes()
            assert metric(b, 'vitserve_images_total{outcome="encoded"}') == 0  # B encoded nothing
            assert metric(b, 'vitserve_cache_hits_total{layer="shared"}') == 1
            assert metric(a, 'vitserve_images_total{outcome="encoded"}') == 1

            # Redis killed mid-run: requests in flight on both replicas, old and new images, all succeed
            images = [noise_png(64 + 8 * k, 64, seed=100 + k) for k in range(3)] + [img]
            jobs = [(url, [images[k]], f"r{k}") for k in range(4) for url in (a.url, b.url)]
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(encode, *job) for job in jobs]
                time.sleep(0.5)
                server.kill()
                results = [f.result() for f in futures]  # raises on any non-200
            # and after it: new images on both replicas (the wave above may all finish before the kill on a
            # quiet machine), each a shared lookup that meets a dead server
            after = [noise_png(64, 72 + 8 * k, seed=200 + k) for k in range(2)]
            results += [encode(url, [after[k]], f"after{k}") for k in range(2) for url in (a.url, b.url)]
            assert all(len(r) == 1 and r[0]["num_tokens"] > 0 for r in results)
        finally:
            out_a, out_b = stop(a), stop(b)
    for out in (out_a, out_b):
        assert PASSWORD not in out
        assert "cache_url=redis://127.0.0.1:" in out  # the banner (/v1/info's cache), password-free
    assert any("is unavailable" in out for out in (out_a, out_b)), out_a[-3000:] + out_b[-3000:]
