"""Concurrent clients (docs/design.md invariant 8), a burst against a full queue (12), a client leaving while
queued (5, 10) and the budget guard (9) through a real uvicorn server, driven by vitserve's own clients."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import threading
import time

import httpx
import pytest
import torch
from PIL import Image

from tests.e2e.live import live_server, noise_png, wait_until
from vitserve.client import AsyncVitserveClient, VitserveClient, VitserveClientError

pytestmark = pytest.mark.timeout(180)
SIZES = [(40, 30), (200, 150), (64, 640), (500, 380), (90, 90), (333, 77), (1200, 900), (28, 28)]


def test_concurrent_clients_all_succeed_and_match_single_runs():
    images = [noise_png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    with live_server() as srv:
        with VitserveClient(srv.url) as c:  # reference: each image alone
            single = [c.encode([img], return_embeddings=True)["images"][0] for img in images]

        async def one_client(k: int) -> list[dict]:
            async with AsyncVitserveClient(srv.url) as ac:
                out = []
                for j in range(3):
                    picks = [(k + j + m) % len(images) for m in range(1 + (k % 3))]
                    resp = await ac.encode(
                        [images[p] for p in picks], return_embeddings=True, request_id=f"c{k}-{j}"
                    )
                    out.extend(zip(picks, resp["images"], strict=True))
                return out

        async def all_clients():
            return await asyncio.gather(*(one_client(k) for k in range(16)))

        results = asyncio.run(all_clients())
    seen = 0
    for per_client in results:
        for pick, img in per_client:
            ref = single[pick]
            assert img["image_id"] == ref["image_id"]
            assert img["num_tokens"] == ref["num_tokens"] == img["embedding"].shape[0]
            torch.testing.assert_close(
                img["embedding"], ref["embedding"], rtol=1e-5, atol=1e-5
            )  # fp32 round-off
            seen += 1
    assert seen == sum(3 * (1 + (k % 3)) for k in range(16))
    assert srv.metrics.value("vitserve_requests_total", code="200") == len(images) + 48


def test_burst_of_ten_times_queue_capacity():
    img = noise_png(112, 112)  # 16 tokens at the test budget
    with live_server(max_queue_tokens=64) as srv, srv.client() as c:
        srv.gate.clear()  # hold the encoder so the burst meets a full queue
        accepted: list[httpx.Response] = []

        def send(results: list, seed: int):  # distinct images: identical ones would share one queued encode
            with srv.client() as cc:
                results.append(cc.post("/encode", files=[("images", ("x.png", noise_png(112, 112, seed)))]))

        waiting = [threading.Thread(target=send, args=(accepted, 100 + k)) for k in range(5)]
        for t in waiting:
            t.start()
        # the first request's image is in flight (held at the gate); the other 4 x 16 tokens fill the queue
        wait_until(lambda: srv.engine.queue_tokens == 64, "4 requests x 16 tokens queued")
        t0 = time.monotonic()
        rejected = [c.post("/encode", files=[("images", ("x.png", img))]) for _ in range(36)]
        reject_s = time.monotonic() - t0
        assert c.get("/ready").status_code == 200
        srv.gate.set()
        for t in waiting:
            t.join(60)
    assert [r.status_code for r in accepted] == [200] * 5
    for r in rejected:
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
    print(f"burst: 36 rejections answered in {reject_s * 1000:.0f} ms while the encoder was held")


def test_client_disconnect_while_queued_is_never_encoded():
    filler, gone_img, other_img = (noise_png(100, 100, seed=s) for s in (10, 11, 12))
    with live_server() as srv:
        srv.gate.clear()
        done: list[httpx.Response] = []

        def patient():
            with srv.client() as cc:
                done.append(cc.post("/encode", files=[("images", ("f.png", filler))]))

        def impatient():
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.Client(base_url=srv.url, timeout=httpx.Timeout(30, read=1.0)) as cc,
            ):
                cc.post("/encode", files=[("images", ("g.png", gone_img))])

        held = threading.Thread(target=patient)
        held.start()
        wait_until(
            lambda: srv.metrics.value("vitserve_batch_images_count") == 1, "the filler in flight, held"
        )
        t = threading.Thread(target=impatient)
        t.start()
        wait_until(lambda: srv.engine.queue_items == 1, "the impatient request's image queued")
        t.join(30)
        wait_until(lambda: srv.engine.queue_items == 0, "the disconnected request's images withdrawn")
        srv.gate.set()
        held.join(30)
        with VitserveClient(srv.url) as c:
            c.encode([other_img])
        assert [r.status_code for r in done] == [200]
        assert (
            srv.metrics.value("vitserve_batch_images_sum") == 2
        )  # filler and other: `gone` never reached it
        assert srv.metrics.value("vitserve_requests_total", code="499") == 1


def test_budget_guard_clamps_an_oversized_image():
    with live_server() as srv, VitserveClient(srv.url) as c:
        budget = srv.config.visual_batch_max_tokens
        out = c.encode([noise_png(1600, 1200)], return_embeddings=True)["images"][0]
        assert out["clamped"] is True
        assert out["num_tokens"] <= budget
        assert out["embedding"].shape[0] == out["num_tokens"]
        assert out["resized_size"][0] < 1600
        small = c.encode([noise_png(56, 56)])["images"][0]
        assert small["clamped"] is False
        info = c.info()
        assert info["budget_tokens"] == budget
        assert info["processor_clamp"]
        text = httpx.get(srv.url + "/metrics").text
        assert "vitserve_images_clamped_total 1.0" in text


async def test_async_client_errors_carry_status_and_code():
    with live_server(max_images_per_request=1) as srv:
        async with AsyncVitserveClient(srv.url) as ac:
            with pytest.raises(VitserveClientError) as exc:
                await ac.encode([b"junk"])
            assert (exc.value.status, exc.value.code, exc.value.image_index) == (400, "invalid_image", 0)
            with pytest.raises(VitserveClientError) as exc:
                await ac.encode([b"a", b"b"])
            assert exc.value.code == "too_many_images"
            assert await ac.ready()


def test_client_accepts_paths_bytes_and_pil_images(tmp_path):
    data = noise_png(80, 60, seed=4)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    pil = Image.open(io.BytesIO(data))
    with live_server() as srv, VitserveClient(srv.url) as c:
        out = c.encode([path, str(path), data, pil], request_id="kinds")
        with pytest.raises(TypeError):
            c.encode([12345])
    ids = [img["image_id"] for img in out["images"]]
    assert ids[0] == ids[1] == ids[2] == hashlib.sha256(data).hexdigest()
    assert [img["original_size"] for img in out["images"]] == [[80, 60]] * 4
    assert out["request_id"] == "kinds"


def test_bfloat16_embeddings_travel_bit_exact():
    from tests.fakes import TinyEncoder
    from vitserve.contract import EncodedImage

    class Bf16Encoder(TinyEncoder):
        dtype = torch.bfloat16

        def encode(self, items):
            return [EncodedImage(o.embedding.to(torch.bfloat16)) for o in super().encode(items)]

    data = noise_png(90, 70, seed=6)
    with live_server(encoder=Bf16Encoder()) as srv, VitserveClient(srv.url) as c:
        got = c.encode([data], return_embeddings=True)["images"][0]
        body = {"images": [{"b64": base64.b64encode(data).decode()}], "return_embeddings": True}
        raw = httpx.post(srv.url + "/encode", json=body).json()["images"][0]["embedding"]
    assert raw["dtype"] == "bfloat16"
    assert got["embedding"].dtype == torch.bfloat16
    assert list(got["embedding"].shape) == raw["shape"]
    processor = srv.service.app.state.preprocessor.processor
    direct = Bf16Encoder().encode([processor.preprocess(Image.open(io.BytesIO(data)).convert("RGB"))])[0]
    # exact by construction: the same elementwise TinyEncoder and bf16 cast on the same pixels, one process
    assert torch.equal(got["embedding"].view(torch.int16), direct.embedding.view(torch.int16))
