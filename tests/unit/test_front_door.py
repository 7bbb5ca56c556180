"""The front door's pure parts (docs/vllm.md): finding image and video parts, the LLM's embedding part per
family, the check before anything goes upstream, OpenAI's error shape, the width the LLM expects, the flags."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.videos import video_metadata
from vitserve import preflight
from vitserve.api.chat_parts import media_parts
from vitserve.checkpoint import Checkpoint
from vitserve.config import Config, redacted_url
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo, ProcessedImage
from vitserve.errors import (
    ConfigError,
    InvalidRequest,
    InvalidVideoSampling,
    LLMUnavailable,
    QueueFull,
    openai_error,
)
from vitserve.flags import build_config
from vitserve.handover.embeds import EmbeddingMismatch, EmbedsLayout
from vitserve.handover.inline import embeds_part, video_embeds_part
from vitserve.handover.inline_body import InlineTensor
from vitserve.handover.upstream import api_base

PNG_B64 = base64.b64encode(b"\x89PNG fake bytes").decode()


def _prepared(grid, tokens) -> PreparedImage:
    item = ProcessedImage(torch.zeros(1), grid, tokens, (28, 28), False)
    return PreparedImage(item, "id", (28, 28), 0.0, 0.0)


def _npy(tensor: InlineTensor) -> np.ndarray:
    """The `.npy` array vLLM would load from the part's tensor (tests/unit/test_inline_body.py: the body)."""
    return np.load(io.BytesIO(tensor.raw()), allow_pickle=False)


def _chat(*contents) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def _video_chat(**fields) -> dict:
    return {**_chat([{"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]), **fields}


def test_image_parts_in_message_order_with_their_json_paths():
    payload = _chat(
        "plain text content",
        [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}},
        ],
        [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}],
    )
    parts = media_parts(payload).images
    assert [p.param for p in parts] == ["messages[1].content[1]", "messages[2].content[0]"]
    assert parts[0].source.data == b"\x89PNG fake bytes"
    assert parts[1].source.url == "https://example.com/x.png"
    assert parts[0].part is payload["messages"][1]["content"][1]  # rewritten in place later


def test_video_parts_take_the_requests_sampling_and_consume_it():
    payload = _video_chat(mm_processor_kwargs={"fps": 4, "max_pixels": 9999})
    payload["messages"][0]["content"].insert(
        0, {"type": "image_url", "image_url": {"url": "https://e.com/a"}}
    )
    payload["messages"][0]["content"].append(
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + PNG_B64}}
    )
    parts = media_parts(payload)
    assert [p.param for p in parts.images] == ["messages[0].content[0]"]
    assert [p.param for p in parts.videos] == ["messages[0].content[1]", "messages[0].content[2]"]
    assert [(p.source.url, p.source.data) for p in parts.videos] == [
        ("https://example.com/v.mp4", None),
        (None, b"\x89PNG fake bytes"),
    ]
    assert [(p.source.fps, p.source.num_frames) for p in parts.videos] == [(4.0, None)] * 2
    # fps was vitserve's to use; what it does not read goes upstream as it came
    assert payload["mm_processor_kwargs"] == {"max_pixels": 9999}
    only_sampling = _video_chat(mm_processor_kwargs={"num_frames": 8})
    assert media_parts(only_sampling).videos[0].source.num_frames == 8
    assert "mm_processor_kwargs" not in only_sampling  # vLLM refuses the field unless it trusts requests
    images_only = {**_chat([{"type": "text", "text": "x"}]), "mm_processor_kwargs": {"fps": 4}}
    assert not media_parts(images_only)
    assert images_only["mm_processor_kwargs"] == {"fps": 4}  # no video: not vitserve's to touch


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"messages": "not a list"}, "'messages' list"),
        ([1, 2], "'messages' list"),
        (_chat([{"type": "image_url", "image_url": {}}]), "messages[0].content[0].image_url"),
        (_chat([{"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}]), "must be base64"),
        (
            _chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]),
            "not valid base64",
        ),
        (_chat([{"type": "image_embeds", "image_embeds": "AAAA"}]), "image_embeds parts are not accepted"),
        (_chat([{"type": "video_embeds", "video_embeds": {}}]), "video_embeds parts are not accepted"),
        (
            _chat([{"type": "video_url", "video_url": "https://x"}, {"type": "video_url"}]),
            "content[1].video_url",
        ),
        (_chat([{"type": "video_url", "video_url": {"url": "data:video/mp4,raw"}}]), "data:video/...;base64"),
        (_video_chat(mm_processor_kwargs=[2]), "mm_processor_kwargs must be an object"),
        (_video_chat(mm_processor_kwargs={"fps": 0}), "mm_processor_kwargs.fps must be a number > 0"),
        (_video_chat(mm_processor_kwargs={"fps": "2"}), "mm_processor_kwargs.fps must be a number > 0"),
        (_video_chat(mm_processor_kwargs={"num_frames": 2.5}), "num_frames must be a whole number >= 1"),
        (_video_chat(mm_processor_kwargs={"num_frames": True}), "num_frames must be a whole number >= 1"),
    ],
)
def test_malformed_parts_are_400_naming_the_part(payload, needle):
    with pytest.raises(InvalidRequest) as err:
        media_parts(payload)
    assert needle in err.value.message
    assert err.value.status == 400


def test_qwen2_5_part_is_a_dict_with_the_flat_grid_and_npy_rows():
    layout = EmbedsLayout("qwen2_5_vl", merge_size=2, width=48)
    emb = torch.randn(6, 48)
    part = embeds_part(layout, _prepared((1, 4, 6), 6), ItemResult(6, emb), 0)
    assert part["type"] == "image_embeds"
    assert part["image_embeds"]["image_grid_thw"] == [1, 4, 6]  # flat: [[1, 4, 6]] is a 400 in vLLM
    arr = _npy(part["image_embeds"]["image_embeds"])
    assert arr.dtype == np.float32
    assert torch.equal(torch.from_numpy(arr), emb)


def test_qwen3_vl_part_concatenates_deepstack_after_the_main_rows_in_order():
    layout = EmbedsLayout("qwen3_vl", merge_size=2, width=3 * 48)
    main, ds0, ds1 = torch.randn(4, 48), torch.randn(4, 48), torch.randn(4, 48)
    part = embeds_part(layout, _prepared((1, 4, 4), 4), ItemResult(4, main, (ds0, ds1)), 0)
    arr = torch.from_numpy(_npy(part["image_embeds"]["image_embeds"]))
    assert torch.equal(arr, torch.cat([main, ds0, ds1], dim=1))


def test_internvl_part_is_a_bare_1_n_hidden_tensor():
    layout = EmbedsLayout("internvl", merge_size=1, width=48)
    emb = torch.randn(8, 48)  # 2 tiles x 4 tokens
    part = embeds_part(layout, _prepared((2, 4, 4), 8), ItemResult(8, emb), 0)
    arr = _npy(part["image_embeds"])
    assert arr.shape == (1, 8, 48)
    assert torch.equal(torch.from_numpy(arr[0]), emb)


@pytest.mark.parametrize(
    ("family", "width", "grid", "emb", "deepstack"),
    [
        ("qwen2_5_vl", 48, (1, 4, 6), torch.zeros(5, 48), ()),  # a row short: kills vLLM's engine
        ("qwen2_5_vl", 48, (1, 4, 6), torch.zeros(6, 32), ()),  # the tower's width, not the LLM's
        ("qwen2_5_vl", 48, (1, 4, 6), torch.zeros(1, 6, 48), ()),  # 3-D for Qwen: kills vLLM's engine
        ("qwen3_vl", 144, (1, 4, 4), torch.zeros(4, 48), ()),  # DeepStack missing
        ("qwen3_vl", 144, (1, 4, 4), torch.zeros(4, 48), (torch.zeros(4, 48),)),  # one level short
    ],
)
def test_a_tensor_the_llm_would_misread_is_refused_before_it_leaves(family, width, grid, emb, deepstack):
    layout = EmbedsLayout(family, merge_size=2, width=width)
    rows = grid[0] * grid[1] * grid[2] // 4
    with pytest.raises(EmbeddingMismatch) as err:
        embeds_part(layout, _prepared(grid, rows), ItemResult(rows, emb, deepstack), 3)
    assert err.value.status == 500
    assert "image 3" in err.value.message
    assert f"({rows}, {width})" in err.value.message


def test_openai_error_shape_and_retry_after():
    status, headers, body = openai_error(
        QueueFull("queue full (--max_queue_tokens)", retry_after_s=2.2), None
    )
    assert status == 503
    assert headers["retry-after"] == "3"
    assert json.loads(body) == {
        "error": {
            "message": "queue full (--max_queue_tokens)",
            "type": "server_error",
            "code": "queue_full",
            "param": None,
        }
    }
    _, _, body = openai_error(InvalidRequest("bad"), "messages[0].content[1]")
    assert json.loads(body)["error"] == {
        "message": "bad",
        "type": "invalid_request_error",
        "code": "invalid_request",
        "param": "messages[0].content[1]",
    }
    assert openai_error(LLMUnavailable("down"))[0] == 502


@pytest.mark.parametrize(("family", "factor"), [("qwen2_5_vl", 1), ("qwen3_vl", 3), ("internvl", 1)])
def test_llm_width_is_the_text_hidden_size_times_deepstack_levels(tmp_path, family, factor):
    ckpt = make_checkpoint(family, tmp_path / family)
    config = json.loads((ckpt / "config.json").read_text())
    width = preflight.llm_embeds_width(Checkpoint.open(ckpt))
    assert width == config["text_config"]["hidden_size"] * factor


def test_front_door_flags(tmp_path):
    with pytest.raises(ConfigError, match="--llm_url must be"):
        build_config(["--llm_url", "zmq://x"], {})
    with pytest.raises(ConfigError, match="set one of them"):
        build_config(["--llm_url", "http://127.0.0.1:8000", "--llm_endpoint", "tcp://127.0.0.1:5"], {})
    with pytest.raises(ConfigError, match="llm_timeout_s"):
        build_config(["--llm_timeout_s", "0"], {})
    config = build_config(["--llm_url", "http://u:pw@127.0.0.1:8000/v1"], {"VITSERVE_LLM_API_KEY": "sekret"})
    assert config.llm_api_key == "sekret"
    assert config.llm_timeout_s == 600
    assert "sekret" not in repr(config)
    assert redacted_url(config.llm_url) == "http://127.0.0.1:8000/v1"
    assert api_base(config.llm_url) == "http://u:pw@127.0.0.1:8000" == api_base("http://u:pw@127.0.0.1:8000/")
    with pytest.raises(ConfigError, match="demo has no language model"):
        preflight.check(build_config(["--llm_url", "http://127.0.0.1:8000"], {}))


def _video(grid, group_rows, **metadata) -> PreparedVideo:
    groups = tuple(_prepared((1, grid[1], grid[2]), group_rows) for _ in range(grid[0]))
    return PreparedVideo(groups, video_metadata(tuple(grid), "vid", **metadata), (), 0.0, 0.0)


def test_video_part_joins_the_groups_in_time_order_with_the_flat_grid():
    layout = EmbedsLayout("qwen2_5_vl", merge_size=2, width=48)
    groups = [torch.randn(6, 48) for _ in range(3)]
    video = _video((3, 4, 6), 6, second_per_grid_t=1.0)
    part = video_embeds_part(layout, video, [ItemResult(6, g) for g in groups], 0)
    assert part["type"] == "video_embeds"
    assert part["video_embeds"]["video_grid_thw"] == [3, 4, 6]
    assert set(part["video_embeds"]) == {"video_embeds", "video_grid_thw"}  # vLLM takes no second_per_grid_ts
    assert torch.equal(torch.from_numpy(_npy(part["video_embeds"]["video_embeds"])), torch.cat(groups))


def test_qwen3_video_part_has_each_groups_timestamp_and_deepstack_after_the_main_rows():
    layout = EmbedsLayout("qwen3_vl", merge_size=2, width=2 * 48)
    main, deep = [torch.randn(4, 48) for _ in range(2)], [torch.randn(4, 48) for _ in range(2)]
    video = _video((2, 4, 4), 4, timestamps_s=(0.25, 1.25))
    results = [ItemResult(4, m, (d,)) for m, d in zip(main, deep, strict=True)]
    part = video_embeds_part(layout, video, results, 0)["video_embeds"]
    assert part["timestamps"] == [0.25, 1.25]
    want = torch.cat([torch.cat(main), torch.cat(deep)], dim=1)
    assert torch.equal(torch.from_numpy(_npy(part["video_embeds"])), want)


def test_a_video_tensor_the_llm_would_misread_is_refused():
    layout = EmbedsLayout("qwen2_5_vl", merge_size=2, width=48)
    video = _video((2, 4, 6), 6, second_per_grid_t=1.0)
    with pytest.raises(EmbeddingMismatch, match=r"video 1: .* expects \(12, 48\)"):
        video_embeds_part(
            layout, video, [ItemResult(6, torch.zeros(6, 48)), ItemResult(5, torch.zeros(5, 48))], 1
        )


@pytest.mark.parametrize(
    ("spg", "groups", "tps", "served"),
    [
        (1.0, 9, 2, True),  # one second per group: what vLLM assumes
        (1.001, 9, 2, True),  # 29.97 fps sampled at fps 2: int(t * 2.002) = 2t for t < 500
        (1.25, 2, 2, True),  # positions 0, 2 either way
        (1.25, 3, 2, False),  # group 2 at int(5.0) = 5, vLLM would put it at 4
        (0.999, 2, 2, False),  # int(1.998) = 1 != 2
        (0.5, 4, 4, False),
        (1.0, 4, None, True),
        (1.001, 4, None, False),  # no time scale named: only exactly 1 s is safe
    ],
)
def test_qwen2_5_video_time_is_served_only_where_vllms_positions_equal_its_own(spg, groups, tps, served):
    layout = EmbedsLayout("qwen2_5_vl", merge_size=2, width=48, tokens_per_second=tps)
    video = _video((groups, 4, 6), 6, second_per_grid_t=spg)
    if served:
        layout.check_video_time(video)
    else:
        with pytest.raises(InvalidVideoSampling, match="second_per_grid_ts") as err:
            layout.check_video_time(video)
        assert err.value.status == 400
        assert f"{spg:.4g} s apart" in err.value.message
    EmbedsLayout("qwen3_vl", merge_size=2, width=48).check_video_time(video)  # timestamps: always served


def test_internvl_video_is_refused_before_decoding_naming_why():
    with pytest.raises(InvalidRequest, match="not served for internvl.*send the video to /encode"):
        EmbedsLayout("internvl", merge_size=1, width=48).check_video_served()
    EmbedsLayout("qwen2_vl", merge_size=2, width=48).check_video_served()


def test_each_transport_is_one_line_of_the_table_under_its_flag_value():
    from vitserve.handover.base import Transport
    from vitserve.handover.transports import TRANSPORTS

    assert {"inline", "ec_storage"} <= set(TRANSPORTS)
    for name, cls in TRANSPORTS.items():
        assert issubclass(cls, Transport)
        assert cls.name == name


async def test_the_inline_hand_over_puts_each_tensor_in_the_body():
    from vitserve.handover.base import Setup
    from vitserve.handover.inline import InlineTransport
    from vitserve.metrics import Metrics

    async def run(fn, *args):
        return fn(*args)

    layout = EmbedsLayout(family="qwen2_5_vl", merge_size=2, width=8)
    handover = InlineTransport(Setup(Config(), layout, Metrics(), run, lambda: "fp")).begin()
    assert not handover.reuses
    assert handover.reused_part(0) is None
    item = ProcessedImage(torch.zeros(1), (1, 4, 6), 6, (28, 28), False)
    image = PreparedImage(item, "0" * 64, (28, 28), 0.0, 0.0)
    rows = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    part = handover.image_part(image, ItemResult(6, rows), 0)
    payload = {"messages": [{"role": "user", "content": [part]}], "mm_processor_kwargs": {"x": 1}}
    sent = json.loads(await handover.ready(payload))
    assert sent["mm_processor_kwargs"] == {"x": 1}  # inline strips nothing: vLLM hashes no uuid here
    b64 = sent["messages"][0]["content"][0]["image_embeds"]["image_embeds"]
    assert torch.equal(torch.from_numpy(np.load(io.BytesIO(base64.b64decode(b64)))), rows)
    handover.check_answer(400, b"The data should contain the fields")  # relayed as it came
    handover.release()


def test_the_front_door_never_branches_on_a_transport():
    """api/chat.py and api/media.py know the hand-over only through its interface (handover/base.py): no
    transport's name, class or module appears in them."""
    import ast
    from pathlib import Path

    from vitserve.handover.transports import TRANSPORTS

    banned = set(TRANSPORTS) | {cls.__name__ for cls in TRANSPORTS.values()} | {"llm_transport"}
    root = Path(__file__).resolve().parents[2] / "vitserve" / "api"
    for name in ("chat.py", "media.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        handover = {m for m in imported if m and m.startswith("vitserve.handover")}
        assert handover <= {"vitserve.handover.base", "vitserve.handover.upstream"}, name
        words = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        words |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        words |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not banned & words, name
