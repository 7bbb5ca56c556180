"""The upstream chat body with inline embeddings (handover/inline_body.py): every tensor decodes, as vLLM decodes it, to
exactly the tensor the part was built from, in its own dtype; splicing the base64 in keeps the JSON valid and
the rest of the request unchanged, for every kind of part."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from tests.videos import video_metadata
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo, ProcessedImage
from vitserve.handover.embeds import EmbedsLayout
from vitserve.handover.inline import embeds_part, video_embeds_part
from vitserve.handover.inline_body import InlineTensor, dumps_body, npy_header

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def vllm_load(text: str) -> torch.Tensor:
    """What vLLM 0.32 does with an embedding's base64 (vllm/multimodal/media/image.py ImageEmbeddingMediaIO):
    strict base64, then np.load for numpy's magic, else torch.load(weights_only=True)."""
    data = base64.b64decode(text, validate=True)
    if data[:6] == b"\x93NUMPY":
        return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
    return torch.load(io.BytesIO(data), weights_only=True)


def _prepared(grid: tuple[int, int, int], tokens: int) -> PreparedImage:
    return PreparedImage(
        ProcessedImage(torch.zeros(1), grid, tokens, (28, 28), False), "id", (28, 28), 0.0, 0.0
    )


def _sent(part: dict[str, Any]) -> Any:
    """The part as vLLM parses it out of the whole body."""
    return json.loads(dumps_body({"messages": [{"role": "user", "content": [part]}]}))["messages"][0][
        "content"
    ][0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_image_embedding_arrives_as_exactly_the_tensor_in_its_own_dtype(dtype):
    layout = EmbedsLayout("qwen2_5_vl", merge_size=2, width=48)
    emb = torch.randn(6, 48).to(dtype)
    sent = _sent(embeds_part(layout, _prepared((1, 4, 6), 6), ItemResult(6, emb), 0))
    got = vllm_load(sent["image_embeds"]["image_embeds"])
    assert got.dtype == dtype  # bf16 stays bf16: not widened to float32
    assert torch.equal(got, emb)
    assert sent["image_embeds"]["image_grid_thw"] == [1, 4, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepstack_levels_arrive_after_the_main_rows_in_order(dtype):
    layout = EmbedsLayout("qwen3_vl", merge_size=2, width=4 * 32)
    main, *deep = (torch.randn(4, 32).to(dtype) for _ in range(4))
    sent = _sent(embeds_part(layout, _prepared((1, 4, 4), 4), ItemResult(4, main, tuple(deep)), 0))
    assert torch.equal(vllm_load(sent["image_embeds"]["image_embeds"]), torch.cat([main, *deep], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_video_arrives_as_its_groups_in_time_order_with_its_timestamps(dtype):
    layout = EmbedsLayout("qwen3_vl", merge_size=2, width=2 * 32)
    main, deep = (
        [torch.randn(4, 32).to(dtype) for _ in range(3)],
        [torch.randn(4, 32).to(dtype) for _ in range(3)],
    )
    groups = tuple(_prepared((1, 4, 4), 4) for _ in range(3))
    video = PreparedVideo(groups, video_metadata((3, 4, 4), timestamps_s=(0.25, 1.25, 2.25)), (), 0.0, 0.0)
    results = [ItemResult(4, m, (d,)) for m, d in zip(main, deep, strict=True)]
    sent = _sent(video_embeds_part(layout, video, results, 0))["video_embeds"]
    assert torch.equal(vllm_load(sent["video_embeds"]), torch.cat([torch.cat(main), torch.cat(deep)], dim=1))
    assert sent["timestamps"] == [0.25, 1.25, 2.25]
    assert sent["video_grid_thw"] == [3, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_internvl_arrives_as_a_bare_1_n_hidden_tensor(dtype):
    emb = torch.randn(8, 48).to(dtype)
    sent = _sent(embeds_part(EmbedsLayout("internvl", 1, 48), _prepared((2, 4, 4), 8), ItemResult(8, emb), 0))
    assert torch.equal(vllm_load(sent["image_embeds"]), emb.unsqueeze(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_view_of_a_larger_tensor_sends_only_its_own_rows(dtype):
    batch = torch.randn(100, 48).to(dtype)  # e.g. one image's rows out of a batch's output
    view = batch[10:16]
    raw = InlineTensor(view).raw()
    assert len(raw) < 100 * 48 * batch.element_size()  # torch.save would write the whole storage of a view
    assert torch.equal(vllm_load(base64.b64encode(raw).decode()), view)


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (2700, 5), (3, 4, 5)])
def test_the_npy_header_is_numpys_own_format_padded_for_base64(shape):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    header = npy_header(array)
    assert len(header) % 192 == 0  # 64: numpy's alignment; 3: base64 of header + data = base64 of the file
    assert np.lib.format.read_magic(io.BytesIO(header)) == (1, 0)
    loaded = np.load(io.BytesIO(header + array.tobytes()), allow_pickle=False)
    assert loaded.shape == shape
    assert np.array_equal(loaded, array)


def test_splicing_keeps_the_json_valid_and_the_rest_of_the_request_unchanged():
    """Every part kind in one request, around text that looks like JSON, escapes and placeholders."""
    tricky = 'quote " backslash \\ newline \n tab \t unicode é 中文 \u2028 emoji 🙂 @0.0@ @abc.1@ {"x": 1}'
    q25, q3 = EmbedsLayout("qwen2_5_vl", 2, 16), EmbedsLayout("qwen3_vl", 2, 32)
    video = PreparedVideo(
        (_prepared((1, 2, 2), 1),) * 2, video_metadata((2, 2, 2), second_per_grid_t=1.0), (), 0.0, 0.0
    )
    parts = [
        {"type": "text", "text": tricky},
        embeds_part(q25, _prepared((1, 2, 2), 1), ItemResult(1, torch.randn(1, 16)), 0),
        embeds_part(
            q3,
            _prepared((1, 2, 2), 1),
            ItemResult(1, torch.randn(1, 16).bfloat16(), (torch.randn(1, 16).bfloat16(),)),
            1,
        ),
        embeds_part(
            EmbedsLayout("internvl", 1, 16), _prepared((1, 2, 2), 2), ItemResult(2, torch.randn(2, 16)), 2
        ),
        video_embeds_part(q25, video, [ItemResult(1, torch.randn(1, 16)) for _ in range(2)], 0),
        {"type": "text", "text": tricky[::-1]},
    ]
    payload = {"model": "m", "messages": [{"role": "user", "content": parts}], "stream": True, "n": None}
    body = dumps_body(payload)
    want = json.loads(json.dumps(payload, default=lambda t: base64.b64encode(t.raw()).decode()))
    assert json.loads(body) == want  # valid JSON, the same request with each tensor's exact base64
    assert json.loads(body.decode("utf-8"))["messages"][0]["content"][0]["text"] == tricky


def test_a_client_text_shaped_like_a_placeholder_is_left_as_it_is():
    payload = {
        "messages": [{"content": [{"text": f"@{'0' * 32}.0@"}, {"x": InlineTensor(torch.ones(1, 2))}]}]
    }
    sent = json.loads(dumps_body(payload))["messages"][0]["content"]
    assert sent[0]["text"] == f"@{'0' * 32}.0@"
    assert torch.equal(vllm_load(sent[1]["x"]), torch.ones(1, 2))


def test_a_body_without_tensors_is_compact_json_and_anything_else_unserializable_is_refused():
    assert dumps_body({"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'.encode()
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        dumps_body({"a": {1}})
