"""vitserve in front of a real vLLM (docs/vllm.md): the same chat request sent straight to vLLM and through
vitserve gives the same answer.

Per family (Qwen2.5-VL, and Qwen3-VL with DeepStack), one tiny checkpoint vLLM can serve
(tests/checkpoints.py make_servable_checkpoint), one real vLLM started from scripts/vllm-env.sh's venv
(tests/vllm_server.py; a serial run starts them when it begins, tests/vllm/servers.py), and the real
vitserve CLI in front of it (--llm_url; the ec_storage cases, --image_resize pil and the tower-less or
non-consumer vLLMs get the CLI's own service run in this process, tests/vllm/stack.py vitserve_in_process).
vLLM is given the raw image directly; vitserve sends it the embeddings instead. Greedy decoding, 12 tokens
with their logprobs: the tokens must be identical and the logprobs within 1e-4 (measured: a few 1e-6, the float
round-off of the same arithmetic in another order; resizing like the PIL processor instead moves them by ~1e-3).

vitserve's budget (256 tokens) is half the checkpoints' own max_pixels (512 merge units), so an image
between the two is clamped by vitserve alone, and vLLM's usage.prompt_tokens shows the clamped count.

The same vLLM takes one video per prompt (`--limit-mm-per-prompt` video 1, which changes nothing for images)
and loads every frame of a raw video (the request's `media_io_kwargs` num_frames -1, not its 32-frame default),
so its own video path and vitserve sample the same frames of a short clip.
"""

from __future__ import annotations

import base64
import io
import json
import re
from fractions import Fraction

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.checkpoints import SERVABLE_FAMILIES, hf_reference
from tests.openai_chat import Answer, assert_same_answer, chat_request, complete, image_url_part
from tests.videos import make_clip
from tests.vllm import servers

# the ec_storage cases, run here against the same vLLMs (tests/vllm/ec_cases.py says why)
from tests.vllm.ec_cases import (
    ec,  # noqa: F401
    test_ec_storage_a_broken_or_vanished_file_never_reaches_vllm,  # noqa: F401
    test_ec_storage_a_repeated_image_reuses_its_file_and_encodes_nothing,  # noqa: F401
    test_ec_storage_a_video_equals_vllms_own_video_path,  # noqa: F401
    test_ec_storage_one_image_equals_vllms_own,  # noqa: F401
    test_ec_storage_refuses_a_clients_uuid,  # noqa: F401
    test_ec_storage_several_images_in_one_body_of_at_most_64_kib,  # noqa: F401
    test_ec_storage_the_directory_stays_within_its_bound,  # noqa: F401
    test_ec_storage_to_a_vllm_that_is_no_consumer_is_a_502_saying_how_to_start_it,  # noqa: F401
    test_ec_storage_to_vllm_without_its_tower,  # noqa: F401
    test_ec_storage_two_replicas_on_one_directory_answer_every_request,  # noqa: F401
)
from tests.vllm.stack import BUDGET, Stack, vitserve_in_process
from tests.vllm.stack import metric as _metric
from tests.vllm.stack import png as _png
from tests.vllm.stack import start_vitserve as _vitserve
from vitserve.checkpoint import Checkpoint
from vitserve.handover.inline_body import InlineTensor, dumps_body

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
SIZES = {"exact": (112, 84), "resized": (301, 203), "clamped": (1500, 1000)}
RAW_VIDEO_TOL = 1e-4  # vLLM's own video path against vitserve's video_embeds


@pytest.fixture(scope="module")
def vllms(tmp_path_factory):
    """Every vLLM this module uses (tests/vllm/servers.py): (checkpoint, tmp dir, server) per family, and
    "bare" (Qwen2.5-VL without its tower). Started at once, or already starting since tests/unit began (a
    serial run); on 2 cores three start-ups overlap in about the time of two in a row; ~3 GiB RSS each."""
    started = servers.take(tmp_path_factory.mktemp("vllm"))
    try:
        yield started
    finally:
        servers.stop(started)


@pytest.fixture(scope="module", params=SERVABLE_FAMILIES)
def stack(request, vllms):
    family = request.param
    ckpt, tmp, vllm = vllms[family]
    vllm.wait_ready()
    vitserve = _vitserve(ckpt, vllm.url, tmp / "vs", "--cache_gb", "1")
    print(f"{family}: vLLM ready in {vllm.ready_s:.0f} s")
    yield Stack(family, ckpt, vllm, vitserve, tmp)
    code = vitserve.terminate()
    vllm.stop()  # its memory back before the next family's tests
    assert code == 0, vitserve.text[-2000:]


def _vllm_requests(stack: Stack) -> float:
    """Requests vLLM finished, by its own counter."""
    return _metric(stack.vllm.url, "vllm:request_success_total")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("size", ["exact", "resized"])
def test_the_answer_equals_vllms_own_from_the_raw_image(stack, size, stream):
    image = image_url_part(_png(*SIZES[size]))
    body = chat_request(stack.model, image, stream=stream)
    direct = complete(stack.vllm.url, body)
    through = complete(stack.vitserve.url, body)
    assert_same_answer(direct, through)


def test_a_repeated_image_is_a_cache_hit_with_the_same_answer(stack):
    image = image_url_part(_png(160, 120, seed=7))
    first = complete(stack.vitserve.url, chat_request(stack.model, image))
    hits = _metric(stack.vitserve.url, "vitserve_cache_hits_total")
    second = complete(stack.vitserve.url, chat_request(stack.model, image))
    assert _metric(stack.vitserve.url, "vitserve_cache_hits_total") == hits + 1
    assert_same_answer(first, second, tol=0.0)
    # a question placed before the image: vLLM's prefix cache cannot cover it, vitserve's cache still does
    before = chat_request(stack.model, image, before="first this:")
    assert_same_answer(complete(stack.vllm.url, before), complete(stack.vitserve.url, before))
    assert _metric(stack.vitserve.url, "vitserve_cache_hits_total") == hits + 2


def test_an_image_above_the_budget_is_clamped_and_vllm_counts_the_clamped_tokens(stack):
    # /encode reports the token counts of images of the same sizes; the chat then sends new images (seed 4),
    # so they are encoded, not cache hits, and the clamp counter moves
    sizes = [_png(*SIZES["clamped"], seed=3), _png(*SIZES["exact"], seed=3)]
    big, small = _png(*SIZES["clamped"], seed=4), _png(*SIZES["exact"], seed=4)
    encoded = httpx.post(
        stack.vitserve.url + "/encode",
        files=[("images", ("big.png", sizes[0])), ("images", ("small.png", sizes[1]))],
        timeout=120,
    ).json()["images"]
    assert encoded[0]["clamped"]
    assert encoded[0]["num_tokens"] <= BUDGET
    clamped_before = _metric(stack.vitserve.url, "vitserve_images_clamped_total")
    answers = {
        name: complete(stack.vitserve.url, chat_request(stack.model, image_url_part(image)))
        for name, image in (("big", big), ("small", small))
    }
    extra = answers["big"].prompt_tokens - answers["small"].prompt_tokens
    assert extra == encoded[0]["num_tokens"] - encoded[1]["num_tokens"]
    assert _metric(stack.vitserve.url, "vitserve_images_clamped_total") == clamped_before + 1
    # vLLM alone keeps the checkpoint's larger limit: the clamp is vitserve's doing, not vLLM's
    direct_big = complete(stack.vllm.url, chat_request(stack.model, image_url_part(big)))
    assert direct_big.prompt_tokens > answers["big"].prompt_tokens
    # an image under the budget is untouched: the same answer as vLLM's own
    body = chat_request(stack.model, image_url_part(small))
    assert_same_answer(complete(stack.vllm.url, body), answers["small"])


def test_a_corrupt_image_is_400_in_openai_shape_and_vllm_never_sees_it(stack):
    before = (_vllm_requests(stack), _metric(stack.vitserve.url, "vitserve_upstream_requests_total"))
    good = image_url_part(_png(64, 64))
    bad = image_url_part(_png(64, 64)[:60])  # a truncated PNG
    body = chat_request(stack.model, good)
    body["messages"][0]["content"].append(bad)
    r = httpx.post(stack.vitserve.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_image"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages[0].content[2]"
    after = (_vllm_requests(stack), _metric(stack.vitserve.url, "vitserve_upstream_requests_total"))
    assert after == before


def test_pil_resize_equals_vllm_given_transformers_pil_pixels(stack):
    """--image_resize pil: the embeddings of transformers' PIL image processor, which vLLM is then given
    as transformers computed them (vLLM itself would resize the other way)."""
    from transformers import Qwen2VLImageProcessorPil

    image = _png(*SIZES["resized"], seed=5)
    processed = Qwen2VLImageProcessorPil.from_pretrained(str(stack.ckpt))(
        images=Image.open(io.BytesIO(image)).convert("RGB"), return_tensors="pt"
    )
    reference = hf_reference(stack.ckpt, stack.family)
    embeds, deepstack = reference(processed["pixel_values"], processed["image_grid_thw"])
    tensor = torch.cat([embeds, *deepstack], dim=1).numpy()  # DeepStack after the main rows
    buf = io.BytesIO()
    np.save(buf, tensor, allow_pickle=False)
    part = {
        "type": "image_embeds",
        "image_embeds": {
            "image_embeds": base64.b64encode(buf.getvalue()).decode(),
            "image_grid_thw": processed["image_grid_thw"][0].tolist(),
        },
    }
    with vitserve_in_process(stack.ckpt, stack.vllm.url, stack.tmp / "pil", "--image_resize", "pil") as pil:
        given = complete(stack.vllm.url, chat_request(stack.model, part))
        through = complete(pil.url, chat_request(stack.model, image_url_part(image)))
    assert_same_answer(given, through)


def test_a_bfloat16_embedding_is_sent_as_torch_save_and_vllm_reads_exactly_its_values(stack):
    """A bf16 tower's embedding stays bf16 on the wire (handover/inline_body.py: torch.save bytes, which vLLM loads with
    torch.load(weights_only=True)): vLLM answers exactly as it does given the same values widened to float32
    as `.npy` (bf16 -> float32 is exact, and vLLM casts to its float32 either way), logprob for logprob."""
    width = Checkpoint.open(stack.ckpt).llm_embeds_width
    emb = torch.randn(6, width, generator=torch.Generator().manual_seed(7)).bfloat16()

    def answer(tensor: torch.Tensor) -> Answer:
        part = {
            "type": "image_embeds",
            "image_embeds": {"image_embeds": InlineTensor(tensor), "image_grid_thw": [1, 4, 6]},
        }
        body = json.loads(dumps_body(chat_request(stack.model, part)))  # the exact base64 vitserve would send
        sent = body["messages"][0]["content"][0]["image_embeds"]["image_embeds"]
        magic = b"\x93NUMPY" if tensor.dtype == torch.float32 else b"PK\x03\x04"  # .npy, or torch.save's zip
        assert base64.b64decode(sent).startswith(magic)
        return complete(stack.vllm.url, body)

    assert_same_answer(answer(emb), answer(emb.float()), tol=0.0)


@pytest.mark.parametrize("stack", ["qwen2_5_vl"], indirect=True)
def test_vllm_without_its_vision_tower_gives_the_same_answers(stack, vllms, clip):
    """vLLM with --limit-mm-per-prompt image 0 builds no tower: the memory the sidecar frees. Qwen2.5-VL
    only: for Qwen3-VL vLLM then turns DeepStack off too (docs/vllm.md), so it keeps its tower there."""
    bare = vllms["bare"][2].wait_ready()  # started with the others (the vllms fixture)
    try:
        assert "vision" not in bare.log_tail(400).lower() or bare.alive()
        with vitserve_in_process(stack.ckpt, bare.url, stack.tmp / "bare") as vitserve:
            for size in ("exact", "resized"):
                body = chat_request(stack.model, image_url_part(_png(*SIZES[size], seed=11)))
                assert_same_answer(complete(stack.vllm.url, body), complete(vitserve.url, body))
            # above vitserve's budget, vLLM alone would not clamp: compare with vitserve before the full vLLM
            body = chat_request(stack.model, image_url_part(_png(*SIZES["clamped"], seed=11)))
            assert_same_answer(complete(stack.vitserve.url, body), complete(vitserve.url, body))
            # video_embeds need no tower either (video 0 in the limit)
            video = {
                **chat_request(stack.model, _video_url_part(clip)),
                "mm_processor_kwargs": VIDEO_SAMPLING,
            }
            assert_same_answer(complete(stack.vitserve.url, video), complete(vitserve.url, video))
            refused = httpx.post(
                bare.url + "/v1/chat/completions",
                json=chat_request(stack.model, image_url_part(_png(64, 64))),
                timeout=60,
            )
            assert refused.status_code == 400  # raw images: it has no tower to encode them
            assert bare.alive()
            # vLLM stopped: 502 llm_unavailable in OpenAI's shape, and /encode keeps serving
            bare.stop()
            r = httpx.post(vitserve.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 502
            assert r.json()["error"]["code"] == "llm_unavailable"
            ok = httpx.post(vitserve.url + "/encode", files={"images": ("a.png", _png(64, 64))}, timeout=60)
            assert ok.status_code == 200
    finally:
        bare.stop()


# A clip at 2 fps, 8 frames: 4 temporal groups 1 s apart, so Qwen2.5-VL's second_per_grid_t is 1.0, the time
# vLLM assumes for video_embeds (docs/vllm.md, "Video"); both sides sample all 8 frames.
CLIP_FRAMES, CLIP_FPS = 8, 2
VIDEO_SAMPLING = {"num_frames": CLIP_FRAMES}


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(CLIP_FRAMES, "mp4", fps=Fraction(CLIP_FPS), size=(160, 96))


def _video_url_part(data: bytes) -> dict:
    return {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()},
    }


def _transformers_video_embeds(stack: Stack, data: bytes) -> dict:
    """vLLM's video_embeds part made by transformers alone: its video processor on every frame (decoded as
    its PyAV loader does), model.visual on the result (DeepStack after the main rows), Qwen3-VL's timestamps
    as vLLM computes them from the sampled frames (the mean time of each group's two frames)."""
    import av
    from transformers import AutoVideoProcessor

    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    processed = AutoVideoProcessor.from_pretrained(str(stack.ckpt), local_files_only=True)(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
        video_metadata=[{"total_num_frames": len(frames), "fps": float(CLIP_FPS)}],
        do_sample_frames=True,
        return_metadata=True,
        return_tensors="pt",
        fps=None,  # Qwen3-VL's class default (2) would clash with num_frames
        cap_pixels_per_frame=False,  # transformers' current default, said so (vitserve's too)
        **VIDEO_SAMPLING,
    )
    embeds, deepstack = hf_reference(stack.ckpt, stack.family)(
        processed["pixel_values_videos"], processed["video_grid_thw"]
    )
    buf = io.BytesIO()
    np.save(buf, torch.cat([embeds, *deepstack], dim=1).numpy(), allow_pickle=False)
    part = {
        "video_embeds": base64.b64encode(buf.getvalue()).decode(),
        "video_grid_thw": processed["video_grid_thw"][0].tolist(),
    }
    if stack.family == "qwen3_vl":
        seconds = [int(i) / CLIP_FPS for i in processed["video_metadata"][0].frames_indices]
        part["timestamps"] = [(a + b) / 2 for a, b in zip(seconds[::2], seconds[1::2], strict=True)]
    return {"type": "video_embeds", "video_embeds": part}


def test_a_video_gives_the_answer_of_vllm_given_transformers_video_embeddings(stack, clip):
    body = chat_request(stack.model, _video_url_part(clip))
    through = complete(stack.vitserve.url, {**body, "mm_processor_kwargs": VIDEO_SAMPLING})
    given = complete(stack.vllm.url, chat_request(stack.model, _transformers_video_embeds(stack, clip)))
    assert_same_answer(given, through)  # prompt_tokens included: the video's placeholder count


def test_a_video_gives_the_answer_of_vllms_own_video_path(stack, clip):
    """vLLM decodes the raw clip itself (OpenCV, every frame by the request's media_io_kwargs) and runs its
    own tower (measured for Qwen2.5-VL: logprobs 2.4e-6 apart, the same tokens)."""
    body = chat_request(stack.model, _video_url_part(clip))
    direct = complete(stack.vllm.url, {**body, "media_io_kwargs": {"video": {"num_frames": -1}}})
    through = complete(stack.vitserve.url, {**body, "mm_processor_kwargs": VIDEO_SAMPLING})
    assert_same_answer(direct, through, tol=RAW_VIDEO_TOL)


def test_a_corrupt_video_is_400_and_vllm_never_sees_it(stack, clip):
    before = (_vllm_requests(stack), _metric(stack.vitserve.url, "vitserve_upstream_requests_total"))
    body = chat_request(stack.model, _video_url_part(clip[: len(clip) // 3]))
    r = httpx.post(stack.vitserve.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_video"
    assert error["param"] == "messages[0].content[0]"
    after = (_vllm_requests(stack), _metric(stack.vitserve.url, "vitserve_upstream_requests_total"))
    assert after == before


def test_vllm_stayed_alive_through_every_test(stack):
    assert stack.vllm.alive()
    assert not re.search(r"EngineDeadError|EngineCore.*died", stack.vllm.log_path.read_text(errors="replace"))
