"""The HTTP front door over the REAL Engine (spawned worker processes, a tiny real Qwen2.5-VL checkpoint) and a
real LLM-side EmbeddingReceiver: concurrent clients end to end (docs/design.md invariants 8 and 11), and bad input leaves the workers untouched."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.live import live_server, noise_png, wait_until
from tests.receivers import ReceiverThread
from vitserve.client import AsyncVitserveClient, VitserveClient

engine_mod = pytest.importorskip("vitserve.engine")
pytestmark = pytest.mark.timeout(600)
BUDGET = 32
SIZES = [(40, 30), (200, 150), (64, 640), (500, 380), (90, 90), (333, 77), (1200, 900), (28, 28)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    return make_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def real(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt")
    endpoint = f"ipc://{tmp}/llm.sock"
    receiver = ReceiverThread(endpoint)  # reads (and acknowledges) while the requests wait
    # the tiny checkpoint's own processor allows 64 tokens; a 32-token budget makes the clamp do real work
    with live_server(
        model=str(checkpoint),
        visual_batch_max_tokens=BUDGET,
        max_queue_tokens=100_000,
        heartbeat_s=2,
        dist_timeout_s=60,
        device="cpu",
        runtime_dir=str(tmp),
        llm_endpoint=endpoint,
        request_timeout_s=120,
        make_engine=engine_mod.Engine,
    ) as srv:
        yield srv, receiver
    receiver.close()


def drain(receiver, n: int) -> list:
    return receiver.take(n, timeout_s=60)


def test_real_engine_concurrent_clients_match_single_runs_and_reach_the_llm_once(real):
    srv, receiver = real
    images = [noise_png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    with VitserveClient(srv.url) as c:
        single = [
            c.encode([img], return_embeddings=True, request_id=f"single-{i}")["images"][0]
            for i, img in enumerate(images)
        ]
    got_single = drain(receiver, len(images))
    assert sorted(e.request_id for e in got_single) == sorted(f"single-{i}" for i in range(len(images)))

    async def one_client(k: int):
        picks = [(k + m) % len(images) for m in range(1 + k % 2)]
        async with AsyncVitserveClient(srv.url) as ac:
            resp = await ac.encode([images[p] for p in picks], return_embeddings=True, request_id=f"c{k}")
        return picks, resp

    async def everyone():
        return await asyncio.gather(*(one_client(k) for k in range(16)))

    out = asyncio.run(everyone())
    expected = {(resp["request_id"], i) for _, resp in out for i in range(len(resp["images"]))}
    received = drain(receiver, len(expected))
    keys = [(e.request_id, e.image_index) for e in received]
    assert sorted(keys) == sorted(expected)  # every image reached the LLM exactly once
    by_key = {(e.request_id, e.image_index): e for e in received}
    for picks, resp in out:
        for i, (pick, img) in enumerate(zip(picks, resp["images"], strict=True)):
            ref = single[pick]
            assert img["image_id"] == ref["image_id"]
            assert img["num_tokens"] == ref["num_tokens"] <= BUDGET
            torch.testing.assert_close(img["embedding"], ref["embedding"], rtol=1e-5, atol=1e-5)
            wire = by_key[(resp["request_id"], i)]
            assert torch.equal(wire.embedding, img["embedding"])  # what the LLM got is what the client got


def test_budget_guard_clamps_and_the_embedding_equals_the_hf_reference(real, checkpoint):
    from tests.checkpoints import hf_reference
    from vitserve.images import decode_image
    from vitserve.processors import load_image_processor

    srv, receiver = real
    data = noise_png(1200, 900, seed=7)
    with VitserveClient(srv.url) as c:
        out = c.encode([data], return_embeddings=True, request_id="clamp")["images"][0]
    drain(receiver, 1)
    assert out["clamped"] is True
    assert out["num_tokens"] <= BUDGET
    assert out["original_size"] == [1200, 900]
    item = load_image_processor(str(checkpoint), budget_tokens=BUDGET).preprocess(
        decode_image(data, max_image_pixels=50_000_000).image
    )
    assert list(item.resized_size) == out["resized_size"]
    assert list(item.grid_thw) == out["grid_thw"]
    ref, _ = hf_reference(checkpoint, "qwen2_5_vl")(item.pixel_values, torch.tensor([item.grid_thw]))
    torch.testing.assert_close(out["embedding"], ref, rtol=1e-4, atol=1e-5)  # fp32 round-off


def test_bad_inputs_leave_workers_untouched_and_next_request_succeeds(real):
    srv, receiver = real
    pids = srv.engine.worker_pids()
    with srv.client() as c:
        for body in (
            {"images": [{"b64": "@@"}]},
            {"images": [{"b64": base64.b64encode(b"junk").decode()}]},
            {"images": []},
        ):
            assert c.post("/encode", json=body).status_code == 400
        ok = c.post(
            "/encode", files=[("images", ("a.png", noise_png(64, 64)))], data={"request_id": "after-bad"}
        )
        assert ok.status_code == 200, ok.text
        info = c.get("/v1/info").json()
    assert drain(receiver, 1)[0].request_id == "after-bad"  # the 400s sent nothing
    assert srv.engine.worker_pids() == pids
    assert info["reserved_source"] == "stress"
    assert info["reserved_memory_bytes"]["0"] > 0


def test_ready_and_metrics_with_real_workers(real):
    srv, _ = real
    with srv.client() as c:
        assert c.get("/ready").json() == {"status": "ready"}
        text = c.get("/metrics").text
    assert "vitserve_workers_ready 1.0" in text


def test_stage_metrics_time_each_part_of_one_request(real):
    """vitserve_stage_seconds gets every stage of a request (docs/api.md): rank 0's own forward lies inside
    the batch's round trip to the rank (encode), which lies inside the handler's engine stage."""
    srv, receiver = real
    stages = ("read", "parse", "prepare", "engine", "respond", "request", "queue", "encode", "forward")

    def sums() -> dict[str, float]:
        return {s: srv.metrics.value("vitserve_stage_seconds_sum", stage=s) or 0.0 for s in stages}

    before = sums()
    with VitserveClient(srv.url) as c:
        c.encode([noise_png(90, 90, seed=99)], request_id="stages")
    drain(receiver, 1)
    took = {s: after - before[s] for s, after in sums().items()}
    assert all(took[s] > 0 for s in stages if s != "queue"), took
    assert took["forward"] < took["encode"] <= took["engine"] < took["request"]
    inside = ("read", "parse", "prepare", "engine", "respond")
    assert sum(took[s] for s in inside) <= took["request"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo tower behind real HTTP; the tests hold its rank with SIGSTOP so work queues behind it
    deterministically, however fast the machine is."""
    tmp = tmp_path_factory.mktemp("demo")
    endpoint = f"ipc://{tmp}/llm.sock"
    receiver = ReceiverThread(endpoint)
    # heartbeat 10 s: the tests below hold the rank (SIGSTOP) for a few seconds; 2 x 10 s is far from "hung".
    with live_server(
        model="demo",
        visual_batch_max_tokens=256,
        max_queue_tokens=1024,
        heartbeat_s=10,
        dist_timeout_s=120,
        device="cpu",
        runtime_dir=str(tmp),
        llm_endpoint=endpoint,
        request_timeout_s=200,
        make_engine=engine_mod.Engine,
    ) as srv:
        yield srv, receiver
    receiver.close()


@contextlib.contextmanager
def held(srv):
    """Stop every encoder rank (SIGSTOP) while the block runs: batches handed to it wait, the rest queue."""
    pids = [pid for group in srv.engine.worker_pids().values() for pid in group]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def drain_in_background(receiver, count: int) -> tuple[threading.Thread, list]:
    """Take `count` messages in the background, as an LLM server would: the HTTP answers wait for the
    receiver's acknowledgements (docs/wire.md)."""
    got: list = []

    def run():
        for _ in range(count):
            got.append(receiver.take(1, timeout_s=120)[0].request_id)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def occupy(srv, request_id: str, n: int = 3) -> tuple[threading.Thread, list]:
    """Send n x 256-token images in the background; returns once the engine holds them."""
    import time

    import httpx

    images = [noise_png(448, 448, seed=s) for s in range(n)]
    before = srv.metrics.value("vitserve_image_tokens_count") or 0
    out: list = []

    def send():
        with httpx.Client(base_url=srv.url, timeout=200) as c:
            out.append(
                c.post(
                    "/encode",
                    files=[("images", (f"{i}.png", b)) for i, b in enumerate(images)],
                    data={"request_id": request_id},
                )
            )

    t = threading.Thread(target=send)
    t.start()
    while (srv.metrics.value("vitserve_image_tokens_count") or 0) < before + n:  # handed to the engine
        time.sleep(0.01)
    return t, out


@pytest.mark.slow  # ~1 min with the demo tower; tests/e2e/test_api_load.py covers the disconnect in the default run
def test_real_engine_disconnect_while_queued_is_never_encoded_nor_sent(demo):
    import httpx

    srv, receiver = demo
    with held(srv):  # "busy" fills the rank, "gone" must wait in the queue
        t, first = occupy(srv, "busy")
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=1.5)) as c,
        ):
            c.post(
                "/encode",
                files=[("images", ("g.png", noise_png(448, 448, seed=99)))],
                data={"request_id": "gone"},
            )
        wait_until(lambda: srv.metrics.value("vitserve_requests_total", code="499") == 1, "the disconnect")
    drained, ids = drain_in_background(receiver, 4)
    t.join(200)
    assert first[0].status_code == 200, first[0].text
    with VitserveClient(srv.url) as c:
        c.encode([noise_png(56, 56)], request_id="marker")
    drained.join(120)
    assert ids == ["busy", "busy", "busy", "marker"]


@pytest.mark.slow  # the default run covers the burst in tests/e2e/test_api_load.py
def test_real_engine_burst_gets_fast_queue_full_and_ready_stays_200(demo):
    import httpx

    srv, receiver = demo
    # distinct images: identical ones would join one in-flight encode (dedup) and add no queued tokens
    imgs = [noise_png(448, 448, seed=100 + k) for k in range(40)]

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=200) as c:

            async def one(k):
                return await c.post(
                    "/encode", files=[("images", ("b.png", imgs[k]))], data={"request_id": f"b{k}"}
                )

            return await asyncio.gather(*(one(k) for k in range(40)))  # 40 x 256 = 10x the 1024-token queue

    drained, got = drain_in_background(
        receiver, 3 + 2
    )  # busy2's 3 images and the 2 burst requests the queue has room for
    pool = ThreadPoolExecutor(1)  # the burst's two admitted requests can only finish after the rank resumes
    try:
        with held(srv):  # 256 tokens on the rank, 512 queued: room for exactly two more 256-token requests
            t, first = occupy(srv, "busy2")
            answers_f = pool.submit(asyncio.run, burst())
            wait_until(
                lambda: (srv.metrics.value("vitserve_requests_total", code="503") or 0) >= 38,
                "38 refusals",
                limit_s=15,
            )
            with srv.client() as c:
                assert c.get("/ready").status_code == 200
        answers = answers_f.result(timeout=200)
    finally:
        pool.shutdown(wait=False)
    t.join(200)
    drained.join(120)
    assert first[0].status_code == 200
    ok = [r for r in answers if r.status_code == 200]
    full = [r for r in answers if r.status_code != 200]
    assert len(ok) == 2
    assert len(full) == 38
    for r in full:
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
    assert sorted(got) == sorted(["busy2"] * 3 + [r.json()["request_id"] for r in ok])


def test_tp2_through_http_matches_the_hf_reference_and_reports_both_ranks(checkpoint, tmp_path):
    from tests.checkpoints import hf_reference
    from vitserve.images import decode_image
    from vitserve.processors import load_image_processor

    data = noise_png(700, 500, seed=8)
    with (
        live_server(
            model=str(checkpoint),
            tp=2,
            visual_batch_max_tokens=BUDGET,
            heartbeat_s=2,
            dist_timeout_s=60,
            device="cpu",
            runtime_dir=str(tmp_path),
            make_engine=engine_mod.Engine,
        ) as srv,
        VitserveClient(srv.url) as c,
    ):
        out = c.encode([data], return_embeddings=True)["images"][0]
        info = c.info()
    assert (info["tp"], info["dp"]) == (2, 1)
    assert sorted(info["reserved_memory_bytes"]) == ["0", "1"]
    item = load_image_processor(str(checkpoint), budget_tokens=BUDGET).preprocess(
        decode_image(data, max_image_pixels=50_000_000).image
    )
    ref, _ = hf_reference(checkpoint, "qwen2_5_vl")(item.pixel_values, torch.tensor([item.grid_thw]))
    torch.testing.assert_close(out["embedding"], ref, rtol=1e-4, atol=1e-5)  # fp32 round-off, TP all_reduce
