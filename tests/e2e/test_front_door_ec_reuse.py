"""A chat request with an image handed over already (--llm_transport ec_storage: its file is still there), on a
real server without a vLLM: the LLM server is tests/e2e/test_front_door_video.py's recording one.

A reused image is an item of the request like any other, at its own index: the image after it keeps its
index too, in the error that names it and in the part that replaces it. What a real EC-consumer vLLM makes
of the files is tests/vllm's.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.live import live_server, png_bytes
from tests.e2e.test_front_door_video import TEXT_HIDDEN, RecordingLLM, chat, data_url
from tests.fakes import TinyEncoder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ROUTE = "/v1/chat/completions"


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}}


@pytest.fixture
def stack(tmp_path):
    ckpt = make_checkpoint("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    llm = RecordingLLM()
    with live_server(
        model=str(ckpt),
        llm_url=llm.url,
        encoder=TinyEncoder(embed_dim=TEXT_HIDDEN),
        llm_transport="ec_storage",
        ec_storage_path=str(tmp_path / "ec"),
    ) as live:
        yield live, llm
    llm.shutdown()
    llm.server_close()


def test_an_image_after_a_reused_one_keeps_its_index(stack):
    live, llm = stack
    reused, fresh = png_bytes(64, 48), png_bytes(128, 56, color=(10, 120, 240))
    with live.client() as c:
        assert c.post(ROUTE, json=chat(image_part(reused))).status_code == 200  # its file is written
        (first,) = llm.bodies[-1]["messages"][0]["content"][:1]

        r = c.post(ROUTE, json=chat(image_part(reused), image_part(b"\x89PNG\r\n\x1a\n not a png")))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_image", "messages[0].content[1]")
        assert len(llm.bodies) == 1  # nothing went upstream

        r = c.post(ROUTE, json=chat(image_part(reused), image_part(fresh)))
        assert r.status_code == 200, r.text
    again, new = llm.bodies[-1]["messages"][0]["content"][:2]
    assert again == first  # the same file named again, not written
    assert new["type"] == "image_embeds"
    assert new["uuid"] != first["uuid"]
    assert new["image_embeds"]["image_grid_thw"] != first["image_embeds"]["image_grid_thw"]
    assert live.metrics.value("vitserve_ec_reuses_total") == 2
    assert live.metrics.value("vitserve_ec_writes_total") == 2
    # rejected counts every image of the refused request, the reused one included (docs/api.md, /metrics)
    assert live.metrics.value("vitserve_images_total", outcome="rejected") == 2
