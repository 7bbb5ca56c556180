"""Videos through the front door on a real server (docs/vllm.md, "Video"), without a vLLM: the LLM server is a
real HTTP server that records every body it is sent and answers a fixed completion.

What vitserve sends upstream for a `video_url` part must be what `/encode` gives for the same video and the
same sampling (the same decoder, sampler, processor and engine path), in vLLM's `video_embeds` form; a bad
video, a sampling vLLM would misplace in time, or a server without decoders never reaches the LLM server.
What a real vLLM makes of it is tests/vllm/test_front_door.py's.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from fractions import Fraction

import httpx
import numpy as np
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.live import live_server, png_bytes
from tests.fakes import TinyEncoder
from tests.videos import make_clip

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
TEXT_HIDDEN = 48  # tests/checkpoints.py's language width: what the LLM expects of every row
ANSWER = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "ok"}}]}


class RecordingLLM(http.server.ThreadingHTTPServer):
    """POST /v1/chat/completions: keeps the JSON body, answers ANSWER."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: list[dict] = []
        self.sizes: list[int] = []  # each body's bytes, as they came
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: RecordingLLM

    def do_POST(self):  # noqa: N802 (http.server's name)
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.sizes.append(len(raw))
        self.server.bodies.append(json.loads(raw))
        out = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):  # quiet
        pass


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*parts: dict, **fields) -> dict:
    content = [*parts, {"type": "text", "text": "what happens?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def video_part(clip: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}


def npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(50, "mp4", fps=Fraction(25), size=(160, 96))  # 2 s at 25 fps


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One Qwen2.5-VL server in front of one recording LLM, for every test that only reads."""
    ckpt = make_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("ckpt") / "qwen2_5_vl")
    llm = RecordingLLM()
    encoder = TinyEncoder(embed_dim=TEXT_HIDDEN)
    with live_server(model=str(ckpt), llm_url=llm.url, encoder=encoder, request_timeout_s=60) as live:
        yield live, llm
    llm.shutdown()
    llm.server_close()


def test_a_video_goes_upstream_as_the_video_embeds_encode_gives(stack, clip):
    live, llm = stack
    image = png_bytes(64, 48)
    body = chat(
        {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}},
        video_part(clip),
        mm_processor_kwargs={"fps": 2},
        max_tokens=3,
    )
    sent_bytes = live.metrics.value("vitserve_upstream_body_bytes_sum") or 0.0
    handovers = live.metrics.value("vitserve_stage_seconds_count", stage="handover") or 0.0
    with live.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == ANSWER
        video = {"b64": base64.b64encode(clip).decode(), "fps": 2}
        encoded = c.post("/encode", json={"videos": [video], "return_embeddings": True}).json()["videos"][0]
    sent = llm.bodies[-1]
    assert live.metrics.value("vitserve_upstream_body_bytes_sum") == sent_bytes + llm.sizes[-1]
    assert live.metrics.value("vitserve_stage_seconds_count", stage="handover") == handovers + 1
    assert "mm_processor_kwargs" not in sent  # vitserve sampled the video; vLLM would refuse the field
    assert sent["max_tokens"] == 3  # every other field as it came
    image_part, sent_video, text = sent["messages"][0]["content"]
    assert image_part["type"] == "image_embeds"
    assert text == {"type": "text", "text": "what happens?"}
    assert set(sent_video) == {"type", "video_embeds"}
    assert sent_video["type"] == "video_embeds"
    embeds = sent_video["video_embeds"]
    assert set(embeds) == {"video_embeds", "video_grid_thw"}
    assert embeds["video_grid_thw"] == encoded["grid_thw"]
    assert encoded["frame_indices"] == [0, 12, 25, 37]  # fps 2 of a 2 s clip: 4 frames, 2 groups
    assert encoded["second_per_grid_t"] == 1.0  # 1 s apart: the time vLLM assumes
    rows = npy(embeds["video_embeds"])
    assert rows.shape == (encoded["num_tokens"], TEXT_HIDDEN) == tuple(encoded["embedding"]["shape"])
    want = np.frombuffer(base64.b64decode(encoded["embedding"]["b64"]), np.float32).reshape(rows.shape)
    assert np.array_equal(rows, want)  # the same pixels through the same engine: the same bytes


def test_a_corrupt_video_is_400_naming_its_part_and_never_goes_upstream(stack, clip):
    live, llm = stack
    sent = len(llm.bodies)
    with live.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(video_part(clip[: len(clip) // 3])))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_video"
    assert error["param"] == "messages[0].content[0]"
    assert len(llm.bodies) == sent


def test_a_sampling_vllm_would_misplace_in_time_is_400_before_encoding(stack, clip):
    """fps 4 of a 2 s clip: 8 frames, 4 groups 0.5 s apart; vLLM would put them 1 s apart."""
    live, llm = stack
    sent = len(llm.bodies)
    batches = live.metrics.value("vitserve_batch_images_count")
    with live.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(video_part(clip), mm_processor_kwargs={"fps": 4}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_video_sampling"
    assert "0.5 s apart" in error["message"]
    assert error["param"] == "messages[0].content[0]"
    assert len(llm.bodies) == sent
    assert live.metrics.value("vitserve_batch_images_count") == batches  # nothing was encoded


def test_bad_sampling_kwargs_are_400(stack, clip):
    live, llm = stack
    with live.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat(video_part(clip), mm_processor_kwargs={"fps": -1}))
        assert r.status_code == 400
        assert "mm_processor_kwargs.fps must be a number > 0" in r.json()["error"]["message"]
        both = chat(video_part(clip), mm_processor_kwargs={"fps": 2, "num_frames": 4})
        r = c.post("/v1/chat/completions", json=both)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_video_sampling"


def test_without_video_decoders_a_video_is_400_on_both_routes(tmp_path, clip):
    ckpt = make_checkpoint("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    llm = RecordingLLM()
    encoder = TinyEncoder(embed_dim=TEXT_HIDDEN)
    try:
        with (
            live_server(model=str(ckpt), llm_url=llm.url, encoder=encoder, video_decoders=0) as live,
            live.client(timeout=60) as c,
        ):
            r = c.post("/v1/chat/completions", json=chat(video_part(clip)))
            assert r.status_code == 400
            assert "--video_decoders 0" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "messages[0].content[0]"
            r = c.post("/encode", json={"videos": [{"b64": base64.b64encode(clip).decode()}]})
            assert r.status_code == 400
            assert "--video_decoders 0" in r.json()["error"]["message"]
            info = c.get("/v1/info").json()
            assert (info["video_decoders"], info["video_processor"]) == (0, None)
            ok = c.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}))
            assert ok.status_code == 200
    finally:
        llm.shutdown()
        llm.server_close()
    assert len(llm.bodies) == 1  # only the request without a video


def test_v1_info_lists_the_video_settings(stack):
    live, _ = stack
    with live.client() as c:
        info = c.get("/v1/info").json()
    assert info["video_decoders"] == 2
    assert info["max_video_tokens"] == 16384
    assert {"max_video_bytes", "max_video_duration_s", "max_video_frames"} <= set(info["limits"])
    video = info["video_processor"]
    assert video["default_fps"] == 2.0  # the checkpoint names no fps: the Qwen reference default
    assert video["settings_from"].endswith("video processor config")  # the checkpoint's own file
    assert (video["sampler"], video["temporal_patch_size"]) == ("qwen2", 2)
    assert video["pixels_bound"] == "per_frame"
    assert 0 < video["min_pixels"] < video["max_pixels"]


def test_a_video_url_follows_the_url_policy_of_image_urls(stack):
    live, llm = stack
    sent = len(llm.bodies)
    part = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
    r = httpx.post(live.url + "/v1/chat/completions", json=chat(part), timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "url_not_allowed"  # --allow_image_urls is off
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert len(llm.bodies) == sent
