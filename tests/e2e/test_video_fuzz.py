"""Corrupt, truncated and fuzzed containers POSTed to a real server's /encode (uvicorn, the real video pipeline
and decoder processes, the engine over an in-process encoder group).

Every answer is a 200 whose video is whole, or a 400/413 with one of the video error codes of docs/video.md
naming `video_index` 0: never a 5xx, never a hang (each request has a client timeout under the test's), and
the server still encodes an image and a good video afterwards. The mutants are tests/videos.py's (truncations
and bit flips of real MP4, MKV and WebM clips, also fed to the decoder pool alone in
tests/integration/test_video_decoder_pool.py) plus hand-made corruptions. Four clients send at once, so the
two decoder processes are busy together. The quick run is in the default suite; `-m slow` runs 600 mutants.
"""

from __future__ import annotations

import base64
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.live import live_server, noise_png
from tests.videos import END_OF_SEQUENCE, make_clip, mutants, with_packet_replaced

pytestmark = pytest.mark.timeout(600)
# the video error codes of docs/video.md that bad bytes may get (a decode timeout, 504, is a failure here)
VIDEO_ERRORS = {
    (400, "invalid_video"),
    (400, "unsupported_video"),
    (400, "invalid_video_sampling"),
    (413, "payload_too_large"),
}
CLIENT_TIMEOUT_S = 150  # a hang fails the request; the server's own deadline (120 s) comes first
CLIENTS = 4


@pytest.fixture(scope="module")
def server():
    # the deadline covers the decoder processes' start (importing torch and PyAV: seconds, a minute at load 7)
    with live_server(request_timeout_s=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {kind: make_clip(31, kind) for kind in ("mp4", "mkv", "webm")}


def crafted(clips: dict[str, bytes]) -> list[bytes]:
    """Corruptions that random flips rarely make: a container's magic and header with nothing or noise after
    them, the media data zeroed, a packet replaced by one that decodes to no frame, a file cut after its
    header, two clips glued together."""
    mp4, mkv, webm = clips["mp4"], clips["mkv"], clips["webm"]
    noise = bytes((i * 7919 + 13) % 256 for i in range(4096))
    mdat = mp4.find(b"mdat")
    return [
        mp4[:12],
        mp4[:12] + noise,
        mkv[:4] + noise,
        webm[:64] + noise,
        mp4[: mdat + 4] + bytes(len(mp4) - mdat - 4),
        mp4[: len(mp4) // 2] + bytes(len(mp4) - len(mp4) // 2),
        with_packet_replaced(mkv, 5, END_OF_SEQUENCE),
        with_packet_replaced(mkv, 0, noise[:300]),
        mkv + mkv,
        webm[: len(webm) // 3],
    ]


def post(url: str, blob: bytes) -> httpx.Response:
    body = {"videos": [{"b64": base64.b64encode(blob).decode()}], "return_embeddings": False}
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        return client.post(f"{url}/encode", json=body)


def check(response: httpx.Response, what: str) -> str:
    """The outcome's name; fails the test on anything but a whole video or a documented video error."""
    if response.status_code == 200:
        [video] = response.json()["videos"]
        frames = len(video["frame_indices"])
        assert frames >= 2, (what, video)
        assert video["grid_thw"][0] == math.ceil(frames / 2), (what, video)
        assert video["num_tokens"] > 0, (what, video)
        assert video["total_frames"] > max(video["frame_indices"]), (what, video)
        return "encoded"
    error = response.json()["error"]
    assert (response.status_code, error["code"]) in VIDEO_ERRORS, (what, response.status_code, error)
    assert error.get("video_index") == 0, (what, error)
    return error["code"]


def fuzz(url: str, blobs: list[tuple[str, bytes]]) -> dict[str, int]:
    with ThreadPoolExecutor(CLIENTS) as clients:
        responses = list(clients.map(lambda item: post(url, item[1]), blobs))
    outcomes: dict[str, int] = {}
    for (what, _), response in zip(blobs, responses, strict=True):
        outcome = check(response, what)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def still_serves(url: str, clip: bytes) -> None:
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        image = client.post(
            f"{url}/encode", json={"images": [{"b64": base64.b64encode(noise_png(64, 48)).decode()}]}
        )
        assert image.status_code == 200, image.text
        good = post(url, clip)
    assert good.status_code == 200, good.text
    assert good.json()["videos"][0]["frame_indices"] == [
        0,
        7,
        15,
        23,
    ]  # Qwen2.5-VL's fps-2 sampling, 4 frames
    assert good.json()["videos"][0]["total_frames"] == 31


def mutant_blobs(clips: dict[str, bytes], per_kind: int) -> list[tuple[str, bytes]]:
    return [
        (f"{kind} mutant {i}", blob)
        for seed, (kind, clip) in enumerate(clips.items())
        for i, blob in enumerate(mutants(clip, per_kind, seed + 100))
    ]


def test_fuzzed_containers_get_200s_or_documented_4xx_quick(server, clips):
    blobs = [(f"crafted {i}", blob) for i, blob in enumerate(crafted(clips))] + mutant_blobs(clips, 6)
    outcomes = fuzz(server.url, blobs)
    assert sum(outcomes.values()) == len(blobs) == 28
    assert outcomes.get("invalid_video", 0) > 0  # the corpus does reach the decoder's refusals
    still_serves(server.url, clips["mp4"])


@pytest.mark.slow
def test_fuzzed_containers_get_200s_or_documented_4xx(server, clips):
    blobs = mutant_blobs(clips, 200)
    outcomes = fuzz(server.url, blobs)
    assert sum(outcomes.values()) == 600
    still_serves(server.url, clips["mp4"])
