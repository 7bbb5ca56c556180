"""Videos through POST /encode on a real uvicorn server over the REAL Engine (spawned ranks, tiny real
checkpoints): every family's video embedding equals transformers' own full video forward
(`model.visual(pixel_values_videos, grid_thw=video_grid_thw)` on the transformers video processor's output;
InternVL: `get_image_features` on its frames), at TP=1 and TP=2; a request mixes images and videos; a video
sent again is served from the cache; each group reaches the LLM receiver in order (docs/video.md)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import torch
from transformers import AutoVideoProcessor

from tests.checkpoints import hf_reference, make_checkpoint
from tests.e2e.live import live_server, noise_png, wait_until
from tests.receivers import ReceiverThread
from tests.videos import END_OF_SEQUENCE, make_clip, with_packet_replaced
from vitserve.rpc.tensors import tensor_from_buffer

engine_mod = pytest.importorskip("vitserve.engine")
pytestmark = pytest.mark.timeout(900)
FPS = 25
# the request's sampling per family, and transformers' keywords for the same (Qwen3-VL's num_frames needs
# fps=None there: "mutually exclusive")
SAMPLING = {
    "qwen2_vl": ({"fps": 8.0}, {"fps": 8.0}),
    "qwen2_5_vl": ({"fps": 8.0}, {"fps": 8.0}),
    "qwen3_vl": ({"num_frames": 7}, {"num_frames": 7, "fps": None}),
    "qwen3_5": ({"fps": 6.0}, {"fps": 6.0}),
    "internvl": ({"num_frames": 5}, {"num_frames": 5}),
}


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(50, "mp4", fps=FPS, size=(160, 96))  # 2 s


def all_frames(data: bytes) -> np.ndarray:
    """(N, H, W, 3) uint8: every frame, as transformers' PyAV loader converts them."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def transformers_video(ckpt, family: str, data: bytes):
    """(embedding, deepstack, metadata) of transformers' processor + tower on the whole video."""
    frames = all_frames(data)
    ref = AutoVideoProcessor.from_pretrained(str(ckpt), local_files_only=True)
    out = ref(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
        video_metadata=[{"total_num_frames": len(frames), "fps": float(FPS)}],
        do_sample_frames=True,
        return_metadata=True,
        return_tensors="pt",
        **({} if family == "internvl" else {"cap_pixels_per_frame": False}),
        **SAMPLING[family][1],
    )
    run = hf_reference(ckpt, family)
    if family == "internvl":  # (1, frames, C, H, W): each frame is one tile of get_image_features
        embedding, deepstack = run(out["pixel_values_videos"][0])
    else:
        embedding, deepstack = run(out["pixel_values_videos"], out["video_grid_thw"])
    return embedding, deepstack, out


def decode_tensor(t: dict) -> torch.Tensor:
    return tensor_from_buffer(base64.b64decode(t["b64"]), t["dtype"], t["shape"])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("family", "tp"), [(family, 1) for family in SAMPLING] + [("qwen2_5_vl", 2), ("qwen3_vl", 2)]
)
def test_video_embedding_equals_transformers_full_video_forward(tmp_path, clip, family, tp):
    """TP=2: the two ranks' all_reduce of row-parallel halves adds float32 round-off of ~1e-7 of the output
    scale (tests/e2e/test_tp2_exact.py), well inside the same 1e-4."""
    ckpt = make_checkpoint(family, tmp_path / "ckpt")
    want, want_deep, ref = transformers_video(ckpt, family, clip)
    image = noise_png(120, 90, seed=3)
    with (
        live_server(
            model=str(ckpt),
            make_engine=engine_mod.Engine,
            heartbeat_s=2.0,
            dist_timeout_s=60.0,
            device="cpu",
            runtime_dir=str(tmp_path / "rt"),
            request_timeout_s=120,
            cache_gb=0.5,
            tp=tp,
            visual_reserved_mem_gb=0.5 if tp > 1 else None,  # skips only the start-up stress, never a request
            visual_infer_batch_size=3,  # chunks of 3 groups (a batch's worth): the video's pixels made in parts
        ) as srv,
        srv.client(timeout=120) as c,
    ):
        video = {"b64": b64(clip), **SAMPLING[family][0]}
        r = c.post(
            "/encode", json={"images": [{"b64": b64(image)}], "videos": [video], "return_embeddings": True}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        alone = c.post("/encode", json={"images": [{"b64": b64(image)}], "return_embeddings": True}).json()
        again = c.post("/encode", json={"videos": [video]})
    assert again.status_code == 200, again.text
    [out] = body["videos"]
    meta = ref["video_metadata"][0]
    assert out["frame_indices"] == [int(i) for i in meta.frames_indices]
    if family != "internvl":  # InternVL's processor gives no grid: one tile per frame
        assert out["grid_thw"] == ref["video_grid_thw"][0].tolist()
    else:
        assert out["grid_thw"][0] == len(meta.frames_indices)
    assert out["total_frames"] == 50
    assert out["source_fps"] == pytest.approx(FPS)
    assert out["sampled_fps"] == pytest.approx(meta.sampled_fps)
    assert out["num_tokens"] == want.shape[0]
    assert (out["clamped"], out["cached"], out["index"]) == (False, False, 0)
    assert ("second_per_grid_t" in out) is (family == "qwen2_5_vl")
    assert ("timestamps_s" in out) is (family in ("qwen3_vl", "qwen3_5"))
    got = decode_tensor(out["embedding"])
    assert got.shape == want.shape
    # Bound: the same float32 tower on the same pixels (bit-equal by construction, tests/unit/
    # test_video_pixels.py), once on the whole video and once per temporal group, which no layer mixes (the
    # difference measured was exactly 0); 1e-4 leaves room for the batch's other rows changing kernel choice.
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-4)
    assert len(out.get("deepstack", [])) == len(want_deep)
    for level, deep in zip(out.get("deepstack", []), want_deep, strict=True):
        torch.testing.assert_close(decode_tensor(level), deep.float(), rtol=0, atol=1e-4)
    # the image of the mixed request is the image encoded alone
    [mixed_image], [alone_image] = body["images"], alone["images"]
    torch.testing.assert_close(
        decode_tensor(mixed_image["embedding"]), decode_tensor(alone_image["embedding"]), rtol=0, atol=1e-5
    )
    [cached] = again.json()["videos"]
    assert cached["cached"] is True
    assert "embedding" not in cached


# ---- the request's shape and its errors, over the real Engine with an in-process encoder group ----------


@pytest.fixture(scope="module")
def small():
    # the deadline covers the decoder processes' start (importing torch and PyAV: seconds, a minute at load 7)
    with live_server(request_timeout_s=180, cache_gb=0.05) as srv:
        yield srv


def test_a_cached_video_is_not_decoded_again(small, clip):
    """The groups' cache keys are known from the probe, the sampling and the plan: a video whose groups are
    all cached is answered without a frame decoded, with the same metadata and embedding."""
    videos = small.service.app.state.videos
    video = {"b64": b64(clip), "num_frames": 10}
    with small.client(timeout=180) as c:
        first = c.post("/encode", json={"videos": [video], "return_embeddings": True})
        assert first.status_code == 200, first.text
        decodes = videos.decodes
        second = c.post("/encode", json={"videos": [video], "return_embeddings": True})
    assert second.status_code == 200, second.text
    assert decodes > 0
    assert videos.decodes == decodes  # nothing decoded for the second
    [a], [b] = first.json()["videos"], second.json()["videos"]
    assert (a.pop("cached"), b.pop("cached")) == (False, True)
    assert a == b  # the metadata, and the embedding's base64 bytes


def test_a_frame_failing_in_a_later_chunk_fails_the_request_cleanly(small):
    """Frames are decoded a chunk at a time while the groups before are encoded: a frame of the last chunk
    that does not decode is still a 400 naming the video, its groups are cancelled, nothing hangs."""
    good = make_clip(
        50, "mkv", fps=FPS, size=(160, 96), preset="ultrafast"
    )  # no B-frames: packet k = frame k
    bad = with_packet_replaced(good, 46, END_OF_SEQUENCE)  # frame 46: the last sampled of 16
    videos = small.service.app.state.videos
    body = {"images": [{"b64": b64(noise_png(40, 30))}], "videos": [{"b64": b64(bad), "num_frames": 16}]}
    with small.client(timeout=180) as c:
        decodes = videos.decodes
        r = c.post("/encode", json=body)
        assert r.status_code == 400, r.text
        assert videos.decodes - decodes == 8  # 8 groups, one a chunk under the budget: the 8th failed
        assert r.json()["error"] == {**r.json()["error"], "code": "invalid_video", "video_index": 0}
        wait_until(lambda: small.engine.queue_tokens == 0, "the failed video's groups left the queue")
        again = c.post("/encode", json={"videos": [{"b64": b64(good), "num_frames": 16}]})
    assert again.status_code == 200, again.text


def test_multipart_videos_with_form_sampling_and_an_image(small, clip):
    files = [
        ("videos", ("a.mp4", clip)),
        ("images", ("i.png", noise_png(64, 48))),
        ("videos", ("b.mp4", clip)),
    ]
    with small.client(timeout=180) as c:
        r = c.post("/encode", files=files, data={"num_frames": "6", "return_embeddings": "true"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["images"]) == 1
    first, second = body["videos"]
    assert [first["index"], second["index"]] == [0, 1]
    assert len(first["frame_indices"]) == 6
    assert first["grid_thw"][0] == 3
    # the same bytes sampled the same way: the second video's groups joined the first's encodes
    assert first["video_id"] == second["video_id"]
    assert decode_tensor(first["embedding"]).shape[0] == first["num_tokens"]
    assert torch.equal(decode_tensor(first["embedding"]), decode_tensor(second["embedding"]))


@pytest.mark.parametrize(
    ("video", "status", "code"),
    [
        ({"b64": b64(b"not a video at all" * 20)}, 400, "unsupported_video"),
        ({"fps": 2, "num_frames": 4}, 400, "invalid_video_sampling"),
        ({"num_frames": 500}, 400, "invalid_video_sampling"),
        ({"fps": -1}, 400, "invalid_request"),
    ],
)
def test_a_bad_video_fails_the_request_naming_its_index(small, clip, video, status, code):
    videos = [{"b64": b64(clip)}, {"b64": b64(clip), **video}]
    with small.client(timeout=180) as c:
        r = c.post("/encode", json={"images": [{"b64": b64(noise_png(32, 32))}], "videos": videos})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    if code != "invalid_request":  # a schema error is found before any video is looked at
        assert error["video_index"] == 1


def test_video_limits_and_form_fields_are_named(small, clip):
    with small.client(timeout=180) as c:
        r = c.post("/encode", files=[("videos", ("a.mp4", clip))], data={"fps": "fast"})
        assert r.status_code == 400
        assert "'fps'" in r.json()["error"]["message"]
        r = c.post("/encode", json={"videos": []})
        assert r.status_code == 400
        assert "no images or videos" in r.json()["error"]["message"]
    with live_server(max_video_frames=10, request_timeout_s=180) as srv, srv.client(timeout=180) as c:
        r = c.post("/encode", json={"videos": [{"b64": b64(clip)}]})
    assert r.status_code == 413, r.text
    assert "--max_video_frames" in r.json()["error"]["message"]


def test_each_group_reaches_the_llm_in_order_with_its_place_and_time_range(clip, tmp_path):
    """Wire v3 (docs/wire.md): the image's message, then one message per temporal group in time order, each
    naming its video, group and count and its time range, whose rows are the response's embedding rows."""
    endpoint = f"ipc://{tmp_path}/llm.sock"
    with (
        ReceiverThread(endpoint) as receiver,
        live_server(llm_endpoint=endpoint, request_timeout_s=180) as srv,
        srv.client(timeout=180) as c,
    ):
        wait_until(lambda: srv.engine.readiness().ready, "the receiver connected")
        image = {"b64": b64(noise_png(64, 48))}
        video = {"b64": b64(clip), "num_frames": 6}
        r = c.post("/encode", json={"images": [image], "videos": [video], "return_embeddings": True})
        assert r.status_code == 200, r.text
        messages = receiver.take(4, timeout_s=30)
    body = r.json()
    [out] = body["videos"]
    assert out["delivered"] is True
    first, *groups = messages
    assert first.video is None
    assert first.image_id == body["images"][0]["image_id"]
    assert [m.image_index for m in messages] == [0, 1, 2, 3]
    assert {m.num_images for m in messages} == {4}
    assert [(m.video.index, m.video.group, m.video.groups) for m in groups] == [(0, g, 3) for g in range(3)]
    assert {m.video.video_id for m in groups} == {out["video_id"]}
    fps = out["source_fps"]
    indices = out["frame_indices"]
    for g, m in enumerate(groups):  # the group's first and last frame, by index / source fps
        assert m.video.start_s == pytest.approx(indices[2 * g] / fps)
        assert m.video.end_s == pytest.approx(indices[2 * g + 1] / fps)
        assert m.grid_thw == (1, *out["grid_thw"][1:])
    rows = torch.cat([m.embedding for m in groups])
    assert torch.equal(rows, decode_tensor(out["embedding"]))
