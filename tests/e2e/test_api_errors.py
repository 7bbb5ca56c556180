"""Every error code of docs/api.md from a real HTTP request, with its status and body; bad input
(docs/design.md invariant 14)."""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import struct
import zlib

import pytest
from PIL import Image

from tests.e2e.live import live_server, noise_png, png_bytes, real_engine_options

pytestmark = pytest.mark.timeout(120)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


ABSENT = object()


def assert_error(resp, status: int, code: str, index=None) -> dict:
    """index: None = not checked, ABSENT = must not be there, int = must equal."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code
    assert isinstance(err["message"], str)
    assert err["message"]
    if index is ABSENT:
        assert "image_index" not in err
    elif index is not None:
        assert err["image_index"] == index
    return err


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height (RGB, 8 bit) with a tiny IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The real Engine (worker processes, tiny checkpoint): bad input must never disturb real workers."""
    options = real_engine_options(tmp_path_factory.mktemp("errors"))
    with live_server(max_request_bytes=256 * 1024, max_images_per_request=4, **options) as srv:
        pids = srv.engine.worker_pids()
        yield srv
        assert srv.engine.worker_pids() == pids  # no worker restarted in this module


@pytest.fixture
def client(live):
    with live.client() as c:
        yield c


def ok_image() -> dict:
    return {"b64": b64(png_bytes(64, 48))}


def test_normal_request_succeeds(client):
    r = client.post("/encode", json={"images": [ok_image()], "request_id": "r-1"})
    assert r.status_code == 200
    body = r.json()
    assert body["request_id"] == "r-1"
    assert set(body) == {"request_id", "model", "images", "timing_ms"}
    assert set(body["timing_ms"]) == {"decode", "preprocess", "queue", "encode", "send"}
    img = body["images"][0]
    assert set(img) == {
        "index",
        "image_id",
        "num_tokens",
        "grid_thw",
        "original_size",
        "resized_size",
        "clamped",
        "cached",
        "delivered",
    }
    assert img["original_size"] == [64, 48]
    assert img["delivered"] is False  # no --llm_endpoint: nothing was sent


# -- bad data and invalid_request ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, "invalid_request"),
        ({"content": b"", "headers": {"content-type": "application/json"}}, "invalid_request"),
        ({"json": {"images": []}}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGVsbG8"}]}}, "invalid_request"),
        ({"json": {"images": [{"b64": "!!!!"}]}}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGk=", "url": "https://x"}]}}, "invalid_request"),
        ({"json": {"images": [{}]}}, "invalid_request"),
        ({"json": {"images": "abc"}}, "invalid_request"),
        ({"json": []}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGk="}], "extra": 1}}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGk=", "extra": 1}]}}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGk="}], "request_id": ""}}, "invalid_request"),
        ({"json": {"images": [{"b64": "aGk="}], "return_embeddings": "maybe"}}, "invalid_request"),
        ({"content": b"images=1", "headers": {"content-type": "text/plain"}}, "invalid_request"),
        ({"files": [("images", ("a.png", png_bytes(8, 8)))], "data": {"colour": "red"}}, "invalid_request"),
        ({"files": [("other", ("a.png", png_bytes(8, 8)))]}, "invalid_request"),
        ({"data": {"request_id": "x"}, "files": [("request_id", ("x", b"x"))]}, "invalid_request"),
    ],
)
def test_malformed_requests_are_400_invalid_request(client, kwargs, code):
    assert_error(client.post("/encode", **kwargs), 400, code)


def test_bad_base64_points_at_the_image(client):
    assert_error(
        client.post("/encode", json={"images": [ok_image(), {"b64": "@@@"}]}), 400, "invalid_request", 1
    )


@pytest.mark.parametrize("side", [16, 160], ids=["parsed-on-the-event-loop", "parsed-on-the-pool"])
def test_json_bodies_either_side_of_the_inline_limit_answer_alike(client, side):
    """api/encode.py parses a JSON body up to INLINE_BODY_BYTES (api/media.py) on the event loop and a larger one on the
    pool; the answers are the same either way."""
    from vitserve.api.media import INLINE_BODY_BYTES

    image = {"b64": b64(noise_png(side, side))}
    assert (len(json.dumps({"images": [image]})) > INLINE_BODY_BYTES) == (side == 160)
    ok = client.post("/encode", json={"images": [image], "request_id": f"side-{side}"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["request_id"] == f"side-{side}"
    assert_error(client.post("/encode", json={"images": [image, {"b64": "@@@"}]}), 400, "invalid_request", 1)


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def jpeg_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        b"definitely not an image",
        b"\x89PNG\r\n\x1a\n",
        truncated(noise_png(64, 64)),
        truncated(jpeg_bytes()),
        b"GIF89a",
        b"",
    ],
    ids=["text", "png-magic-only", "truncated-png", "truncated-jpeg", "gif-magic-only", "empty"],
)
def test_not_an_image_is_400_invalid_image(client, data):
    r = client.post("/encode", json={"images": [ok_image(), {"b64": b64(data)}]})
    assert_error(r, 400, "invalid_image", 1)


def test_multipart_bad_image_and_no_images(client):
    r = client.post("/encode", files=[("images", ("a.png", png_bytes(8, 8))), ("images", ("b.png", b"junk"))])
    assert_error(r, 400, "invalid_image", 1)
    assert_error(client.post("/encode", data={"request_id": "x"}, files=[]), 400, "invalid_request")


def test_multipart_request_succeeds_with_fields(client):
    r = client.post(
        "/encode",
        files=[("images", ("a.png", png_bytes(30, 40)))],
        data={"request_id": "mp-1", "return_embeddings": "true"},
    )
    assert r.status_code == 200
    img = r.json()["images"][0]
    assert r.json()["request_id"] == "mp-1"
    assert img["embedding"]["shape"][0] == img["num_tokens"]


# -- too many images -----------------------------------------------------------------------------------------
def test_one_image_more_than_allowed_is_too_many_images(client):
    assert client.post("/encode", json={"images": [ok_image()] * 4}).status_code == 200
    err = assert_error(
        client.post("/encode", json={"images": [ok_image()] * 5}), 400, "too_many_images", ABSENT
    )
    assert "--max_images_per_request" in err["message"]
    files = [("images", (f"{i}.png", png_bytes(8, 8))) for i in range(5)]
    assert_error(client.post("/encode", files=files), 400, "too_many_images")


# -- degenerate sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(1, 1), (1, 10000), (332, 27), (10000, 1)])
def test_degenerate_sizes_are_400_naming_the_limit_or_200_within_budget(client, live, size):
    r = client.post("/encode", json={"images": [{"b64": b64(png_bytes(*size))}]})
    if r.status_code == 200:
        img = r.json()["images"][0]
        assert 0 < img["num_tokens"] <= live.config.visual_batch_max_tokens
    else:
        err = assert_error(r, 400, r.json()["error"]["code"], 0)
        assert err["code"] in ("image_too_small", "aspect_ratio_too_large")
    assert client.post("/encode", json={"images": [ok_image()]}).status_code == 200  # still serving


def test_extreme_aspect_ratio_is_aspect_ratio_too_large(client):
    assert_error(
        client.post("/encode", json={"images": [{"b64": b64(png_bytes(1, 10000))}]}),
        400,
        "aspect_ratio_too_large",
        0,
    )


# -- decompression bombs -------------------------------------------------------------------------------------
def test_decompression_bomb_header_is_413_before_decoding(client):
    bomb = png_header_only(30000, 30000)
    assert len(bomb) < 200
    err = assert_error(
        client.post("/encode", json={"images": [ok_image(), {"b64": b64(bomb)}]}), 413, "payload_too_large", 1
    )
    assert "--max_image_pixels" in err["message"]


def test_real_60_megapixel_image_is_413_with_the_default_pixel_cap():
    big = io.BytesIO()
    Image.new("L", (7746, 7746), 128).save(big, format="PNG")  # 60.0 MP, compresses to ~60 KB
    with live_server() as srv, srv.client() as c:
        assert srv.config.max_image_pixels == 50_000_000
        r = c.post("/encode", files=[("images", ("big.png", big.getvalue()))])
        assert_error(r, 413, "payload_too_large", 0)


# -- bodies over the cap -------------------------------------------------------------------------------------
def raw_http(port: int, head: bytes, body_chunks: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        try:
            for c in body_chunks:
                s.sendall(c)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed: read what it said
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            part = s.recv(65536)
            if not part:
                break
            data += part
        return data


def test_declared_length_over_cap_is_413_without_reading_the_body(live):
    head = (
        b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    reply = raw_http(live.service.port, head, [])
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"payload_too_large"' in reply
    assert b"--max_request_bytes" in reply


def test_chunked_body_over_cap_is_413(live):
    head = (
        b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"a" * 16384
    chunks = [b"%x\r\n" % len(piece) + piece + b"\r\n"] * 20  # 320 KiB > 256 KiB cap, no length anywhere
    reply = raw_http(live.service.port, head, chunks)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"payload_too_large"' in reply


def test_body_over_cap_via_httpx_is_413(client, live):
    blob = noise_png(300, 300)  # ~270 KB > 256 KiB
    r = client.post("/encode", files=[("images", ("n.png", blob))])
    assert_error(r, 413, "payload_too_large")


# -- over_token_budget, not_ready, encoder_failed, timeout ---------------------------------------------------
def test_image_above_budget_after_clamping_is_413_over_token_budget():
    from vitserve.processors import load_image_processor

    proc = load_image_processor(
        "internvl", budget_tokens=64
    )  # one InternVL tile is 256 tokens: cannot shrink to 64
    with live_server(visual_batch_max_tokens=64, processor=proc) as srv, srv.client() as c:
        err = assert_error(c.post("/encode", json={"images": [ok_image()]}), 413, "over_token_budget", 0)
        assert "--visual_batch_max_tokens" in err["message"]


def test_draining_server_is_503_not_ready(live, client):
    live.service.state.draining = True
    try:
        assert_error(client.post("/encode", json={"images": [ok_image()]}), 503, "not_ready")
        assert_error(client.get("/ready"), 503, "not_ready")
        assert client.get("/health").status_code == 200
    finally:
        live.service.state.draining = False
    assert client.get("/ready").status_code == 200


class BrokenEncoder:
    """A real Encoder whose forward raises, as a worker dying mid-batch looks to the API."""

    def __init__(self):
        from tests.fakes import TinyEncoder

        self._inner = TinyEncoder()
        for name in (
            "family",
            "model_name",
            "embed_dim",
            "num_deepstack",
            "dtype",
            "device",
            "visual",
            "weights_digest",
        ):
            setattr(self, name, getattr(self._inner, name))

    def encode(self, items):
        raise RuntimeError("worker died")


def test_encoder_failure_in_flight_is_503_encoder_failed():
    with live_server(encoder=BrokenEncoder()) as srv, srv.client() as c:
        err = assert_error(c.post("/encode", json={"images": [ok_image()]}), 503, "encoder_failed")
        assert "worker died" in err["message"]  # the rank's own report names the root cause


def test_deadline_is_504_timeout():
    with live_server(request_timeout_s=1.0) as srv, srv.client() as c:
        srv.gate.clear()  # nothing gets encoded: the request waits in the queue past its deadline
        try:
            err = assert_error(c.post("/encode", json={"images": [ok_image()]}), 504, "timeout")
            assert "--request_timeout_s" in err["message"]
            assert srv.engine.queue_items == 0
        finally:
            srv.gate.set()


# -- 404/405 and the shape of framework errors ---------------------------------------------------------------
def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/nope"), 404, "not_found", ABSENT)
    assert_error(client.get("/encode"), 405, "method_not_allowed", ABSENT)


# -- no image bytes in the logs ------------------------------------------------------------------------------
def test_logs_after_bad_inputs_hold_no_image_bytes_or_base64(caplog):
    caplog.set_level(logging.DEBUG)
    bomb, junk, trunc = (
        png_header_only(30000, 30000),
        b"\x00\x01secret-bytes\xff" * 10,
        truncated(noise_png(40, 40)),
    )
    payloads = [bomb, junk, trunc, noise_png(40, 40, seed=3)]
    with live_server(max_request_bytes=64 * 1024, log_level="debug") as srv, srv.client() as c:
        for data in payloads[:3]:
            c.post("/encode", json={"images": [{"b64": b64(data)}]})
            c.post("/encode", files=[("images", ("x.png", data))])
        c.post("/encode", json={"images": [{"b64": b64(payloads[3])[:-3] + "!!!"}]})
        c.post(
            "/encode", content=b"{" + b64(payloads[3]).encode(), headers={"content-type": "application/json"}
        )
        c.post("/encode", files=[("images", ("x.png", noise_png(200, 200)))])  # over the 64 KiB cap
    text = caplog.text
    assert "POST /encode" in text or caplog.records  # the capture saw the server's logging
    for data in payloads:
        encoded = b64(data)
        for i in range(0, max(1, len(encoded) - 24), 24):  # no 24-char window of any image's base64
            assert encoded[i : i + 24] not in text
        assert repr(data[:16])[2:-1] not in text
    assert "secret-bytes" not in text


def test_body_that_trickles_in_past_the_deadline_is_504():
    with (
        live_server(request_timeout_s=1.0) as srv,
        socket.create_connection(("127.0.0.1", srv.service.port)) as s,
    ):
        s.settimeout(30)
        s.sendall(
            b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        reply = b""
        while b"}}" not in reply:  # the rest of the body never comes; read the whole answer
            part = s.recv(65536)
            if not part:
                break
            reply += part
        assert reply.startswith(b"HTTP/1.1 504"), reply[:200]
        assert b'"timeout"' in reply


def test_base64_with_data_url_prefix_and_line_breaks_is_accepted(client):
    raw = b64(png_bytes(50, 40))
    wrapped = "\n".join(raw[i : i + 76] for i in range(0, len(raw), 76))
    r = client.post("/encode", json={"images": [{"b64": "data:image/png;base64," + raw}, {"b64": wrapped}]})
    assert r.status_code == 200, r.text
    assert r.json()["images"][0]["image_id"] == r.json()["images"][1]["image_id"]
