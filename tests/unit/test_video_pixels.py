"""Video pixels (vitserve/video/) against transformers' own video processors, bit for bit, with the grid and
the metadata they give the LLM; and the cut into temporal groups.

The oracle is the torchvision video processor transformers builds from the tiny checkpoint's
video_preprocessor_config.json (AutoVideoProcessor), called the way a model's processor calls it on decoded
frames: every frame of the clip, ``video_metadata={"total_num_frames", "fps"}``, ``do_sample_frames=True``,
``return_metadata=True``, and the request's fps or num_frames. Under a budget it gets the clamp vitserve sets
(``size["longest_edge"]`` of the plan). Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps are
computed from transformers' returned metadata by the expressions of its Qwen2_5_VLProcessor and
Qwen3VLProcessor. Frames are noise (the hardest case for a resize) carrying their own number in a corner.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF
from transformers import AutoVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from tests.checkpoints import FAMILIES, hf_reference, make_checkpoint, write_video_config
from vitserve.config import Config
from vitserve.errors import OverTokenBudget
from vitserve.processors.pixels import resize_uint8
from vitserve.video import ProcessedVideo, Sampling, VideoProcessor, load_video_processor
from vitserve.video.processor import VideoTimes

NTSC = 30000 / 1001  # 29.97 fps
QWEN = tuple(f for f in FAMILIES if f != "internvl")


def clip(frames: int, width: int, height: int) -> np.ndarray:
    """(frames, height, width, 3) uint8 noise; frame k holds k in its top-left 4x4 corner."""
    out = np.stack(
        [np.random.default_rng(k).integers(0, 256, (height, width, 3), dtype=np.uint8) for k in range(frames)]
    )
    out[:, :4, :4] = np.arange(frames, dtype=np.uint8)[:, None, None, None]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-pixels")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


def hf_video(
    ckpt, proc: VideoProcessor, frames: np.ndarray, source_fps: float, video: ProcessedVideo, **request
):
    """transformers' output for the clip under vitserve's plan: (pixel_values_videos, grid or None, metadata).
    ``request`` holds fps or num_frames (transformers samples) or neither (the frames vitserve sampled are
    given to it, with their indices, as a decoder's pre-sampled frames)."""
    ref = AutoVideoProcessor.from_pretrained(str(ckpt), local_files_only=True)
    kwargs = {"fps": request.get("fps"), "num_frames": request.get("num_frames")}
    plan = video.plan
    if proc.settings.resize != "tile":
        kwargs["cap_pixels_per_frame"] = proc.settings.cap_pixels_per_frame
        kwargs["size"] = {"shortest_edge": proc.settings.min_pixels, "longest_edge": plan.longest_edge}
    metadata = {"total_num_frames": len(frames), "fps": source_fps}
    if plan.hf_native and request:
        # channels first: transformers cannot tell the channel axis of a 1-frame (1, H, W, 3) array
        out = ref(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], video_metadata=[metadata], do_sample_frames=True, return_metadata=True,
                  return_tensors="pt", **kwargs)  # fmt: skip
    else:
        picked = torch.from_numpy(frames[list(video.frame_indices)]).permute(0, 3, 1, 2)  # (n, C, H, W)
        if (
            not plan.hf_native
        ):  # vitserve shrank what transformers' rule overshoots: torchvision resizes to it
            width, height = plan.resized_size
            picked = tvF.resize(
                picked, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True
            )
            kwargs = {k: v for k, v in kwargs.items() if k != "size"} | {"do_resize": False}
        metadata["frames_indices"] = list(video.frame_indices)
        out = ref(videos=[picked], video_metadata=[metadata], do_sample_frames=False, return_metadata=True,
                  return_tensors="pt", **kwargs)  # fmt: skip
    pixels = out["pixel_values_videos"]
    grid = out.get("video_grid_thw")
    return (pixels[0] if grid is None else pixels), grid, out["video_metadata"][0]


def assert_equal_to_transformers(ckpt, proc, frames, source_fps, sampling=None, **request) -> ProcessedVideo:
    """vitserve's video equals transformers'; ``sampling``: frames vitserve sampled (else the request's)."""
    sampling = sampling or proc.sample(len(frames), source_fps, **request)
    video = proc.preprocess(frames, sampling)
    pixels, grid, metadata = hf_video(ckpt, proc, frames, source_fps, video, **request)
    assert list(metadata.frames_indices) == list(video.frame_indices)
    assert video.pixel_values_videos.dtype == pixels.dtype == torch.float32
    assert video.pixel_values_videos.shape == pixels.shape
    assert torch.equal(video.pixel_values_videos, pixels), (video.pixel_values_videos - pixels).abs().max()
    tps = proc.settings.temporal_patch_size
    if grid is not None:
        assert grid.tolist() == [list(video.video_grid_thw)]
    else:  # InternVL: one tile per frame
        side = pixels.shape[-1] // proc.settings.patch_size
        assert video.video_grid_thw == (len(video.frame_indices), side, side)
    assert video.sampling.sampled_fps == metadata.sampled_fps
    if proc.family == "qwen2_5_vl":  # Qwen2_5_VLProcessor._process_videos
        assert video.second_per_grid_t == tps / metadata.sampled_fps
    else:
        assert video.second_per_grid_t is None
    if proc.family in ("qwen3_vl", "qwen3_5"):
        want = Qwen3VLProcessor._calculate_timestamps(None, metadata.frames_indices, metadata.fps, tps)
        assert list(video.timestamps_s) == want
    else:
        assert video.timestamps_s is None
    return video


@pytest.mark.parametrize("family", FAMILIES)
def test_fps_sampling_at_29_97_fps_equals_transformers(checkpoints, family):
    video = assert_equal_to_transformers(checkpoints[family], load_video_processor(str(checkpoints[family])),
                                         clip(75, 130, 90), NTSC, fps=2)  # fmt: skip
    assert len(video.frame_indices) == (4 if family.startswith("qwen2") else 5)  # 75 / 29.97 * 2 = 5.005


@pytest.mark.parametrize("family", FAMILIES)
def test_an_odd_frame_count_equals_transformers(checkpoints, family):
    """Qwen: the last group is padded with a copy of the last frame. Qwen2-VL's sampler only takes even
    counts: its 5 frames come pre-sampled, as a decoder's, and transformers gets them with their indices."""
    proc = load_video_processor(str(checkpoints[family]))
    frames = clip(17, 97, 61)
    if proc.settings.sampling.sampler == "qwen2":
        sampling = Sampling((0, 4, 8, 12, 16), total_frames=17, source_fps=25.0, fps=None, num_frames=5)
        video = assert_equal_to_transformers(checkpoints[family], proc, frames, 25.0, sampling)
    else:
        video = assert_equal_to_transformers(checkpoints[family], proc, frames, 25.0, num_frames=5)
    assert len(video.frame_indices) == 5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_fps_equals_transformers_at_fps_2(checkpoints, family):
    """Neither fps nor num_frames: vitserve samples at fps 2, where Qwen2-VL and InternVL's classes would
    crash (sampling on, no fps): the oracle is transformers asked for fps 2."""
    proc = load_video_processor(str(checkpoints[family]))
    frames = clip(40, 64, 64)
    video = proc.preprocess(frames, proc.sample(40, 24.0))
    want = proc.preprocess(frames, proc.sample(40, 24.0, fps=2))
    assert torch.equal(video.pixel_values_videos, want.pixel_values_videos)
    assert_equal_to_transformers(checkpoints[family], proc, frames, 24.0, fps=2)


def test_a_one_frame_clip_equals_transformers_for_internvl(checkpoints):
    proc = load_video_processor(str(checkpoints["internvl"]))
    video = assert_equal_to_transformers(checkpoints["internvl"], proc, clip(1, 64, 48), NTSC, num_frames=1)
    assert video.video_grid_thw[0] == 1


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize(("budget", "max_video"), [(6, 0), (0, 12), (40, 30), (2, 0)])
@pytest.mark.parametrize("size", [(160, 100), (600, 28)])
def test_budgets_clamp_frames_inside_the_processor(checkpoints, family, budget, max_video, size):
    """--visual_batch_max_tokens caps a group and --max_video_tokens the video; transformers with the plan's
    longest_edge gives the same pixels, or, for a wide frame whose short side transformers holds at one
    patch group (over the budget), torchvision's resize to the plan's size does."""
    ckpt = checkpoints[family]
    proc = load_video_processor(str(ckpt), budget, max_video)
    video = assert_equal_to_transformers(ckpt, proc, clip(75, *size), NTSC, fps=2)
    unclamped = load_video_processor(str(ckpt)).plan(*size, len(video.frame_indices))
    groups = video.video_grid_thw[0]
    assert video.plan.clamped
    assert video.plan.hf_native == (size == (160, 100))
    assert video.plan.group_tokens < unclamped.group_tokens
    assert budget == 0 or video.plan.group_tokens <= budget
    assert max_video == 0 or video.num_tokens <= max_video
    assert video.num_tokens == groups * video.plan.group_tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_cap_pixels_per_frame_equals_transformers(tmp_path, family):
    """transformers' qwen-vl-utils cap (off unless the config sets it) with its own max_video_tokens."""
    ckpt = make_checkpoint(family, tmp_path / "c")
    write_video_config(family, ckpt, cap_pixels_per_frame=True, max_video_tokens=8)
    capped = load_video_processor(str(ckpt))
    assert capped.settings.cap_pixels_per_frame
    video = assert_equal_to_transformers(ckpt, capped, clip(40, 200, 120), 10.0, fps=2)
    write_video_config(family, ckpt)
    assert video.plan.group_tokens < load_video_processor(str(ckpt)).plan(200, 120, 8).group_tokens


def test_internvl_tiles_cannot_shrink_over_a_limit_is_a_413(checkpoints):
    ckpt = str(checkpoints["internvl"])  # 4 tokens per 56-px tile
    proc = load_video_processor(ckpt, 0, 12)
    with pytest.raises(OverTokenBudget, match="--max_video_tokens=12"):
        proc.plan(64, 48, 4)
    assert proc.plan(64, 48, 3).num_tokens == 12
    with pytest.raises(OverTokenBudget, match="--visual_batch_max_tokens=3"):
        load_video_processor(ckpt, 3, 0).plan(64, 48, 1)


def test_more_groups_than_max_video_tokens_is_a_413(checkpoints):
    proc = load_video_processor(str(checkpoints["qwen2_vl"]), 0, 3)
    with pytest.raises(OverTokenBudget, match="4 temporal groups"):
        proc.plan(64, 64, 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_frames_resized_before_preprocess_give_the_same_pixels(checkpoints, family):
    """A decoder may resize frames to the plan's size in its own process: the pixels do not change."""
    proc = load_video_processor(str(checkpoints[family]), 6, 0)
    frames = clip(30, 150, 110)
    sampling = proc.sample(30, 10.0, fps=2)
    whole = proc.preprocess(frames, sampling)
    small = np.stack([resize_uint8(frames[i], whole.plan.resized_size) for i in sampling.frame_indices])
    again = proc.preprocess(small, sampling, source_size=(150, 110))
    assert torch.equal(whole.pixel_values_videos, again.pixel_values_videos)


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_cover_the_video_in_order_with_their_times(checkpoints, family):
    proc = load_video_processor(str(checkpoints[family]))
    video = proc.preprocess(clip(17, 64, 64), proc.sample(17, 25.0, num_frames=5))
    groups = list(proc.groups(video))
    count, h, w = video.video_grid_thw
    assert [(g.index, g.count, g.grid_thw) for g in groups] == [(i, count, (1, h, w)) for i in range(count)]
    assert torch.equal(torch.cat([g.pixel_values for g in groups]), video.pixel_values_videos)
    assert sum(g.num_tokens for g in groups) == video.num_tokens
    tps = proc.settings.temporal_patch_size
    indices = list(video.frame_indices) + [video.frame_indices[-1]] * (-len(video.frame_indices) % tps)
    assert [(g.start_s, g.end_s) for g in groups] == [
        (indices[i * tps] / 25.0, indices[i * tps + tps - 1] / 25.0) for i in range(count)
    ]
    if video.timestamps_s is not None:
        assert list(video.timestamps_s) == [(g.start_s + g.end_s) / 2 for g in groups]


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_made_a_chunk_at_a_time_equal_the_whole_videos_pixels(checkpoints, family):
    """group_frames + group_pixels (a chunk of groups, as the engine's feed asks for them, any subset in
    order) give each group's rows of preprocess()'s pixel_values_videos bit for bit: the last group of an
    odd frame count padded with its last frame as transformers pads it."""
    proc = load_video_processor(str(checkpoints[family]), 6, 0)
    frames = clip(31, 150, 110)
    sampling = proc.sample(31, 10.0, num_frames=7 if proc.settings.temporal_patch_size == 1 else 8)
    sampling = Sampling(sampling.frame_indices[:-1], 31, 10.0, None, 7)  # an odd count: a padded group
    whole = proc.preprocess(frames, sampling)
    rows = {g.index: g.pixel_values for g in proc.groups(whole)}
    small = {i: resize_uint8(frames[i], whole.plan.resized_size) for i in sampling.frame_indices}
    for chunk in ([0], [0, 1], [1, 2, 3], [len(rows) - 1], [0, 2, len(rows) - 1], list(range(len(rows)))):
        indices = proc.group_frames(sampling, chunk)
        assert len(indices) == len(chunk) * proc.settings.temporal_patch_size
        pixels = proc.group_pixels(np.stack([small[i] for i in indices]), whole.plan)
        assert len(pixels) == len(chunk)
        for g, got in zip(chunk, pixels, strict=True):
            assert torch.equal(got, rows[g]), (family, chunk, g)
    assert proc.times(sampling) == VideoTimes(whole.group_times, whole.second_per_grid_t, whole.timestamps_s)


@pytest.fixture(scope="module")
def towers(checkpoints):
    return {family: hf_reference(checkpoints[family], family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_encode_to_the_whole_videos_embeddings(checkpoints, towers, family, one_thread):
    """The real transformers tower on the whole video (grid (T, h, w)) and on its T groups (grid (1, h, w)
    each) gives the same embeddings (and Qwen3-VL's deepstack features) within 1e-6.

    Why the bound holds: no operation of these towers mixes two temporal groups. The Conv3d patch embedding
    sees the temporal_patch_size frames of one group; attention runs inside cu_seqlens segments of h*w patches,
    one per group (Qwen2.5-VL's windows are cut inside each group too); the rotary and learned position
    embeddings depend on (row, column) only and are repeated per group; norms, MLPs and the 2x2 merger act on
    one token or one merge block. So each group's output rows are a function of its own pixel rows alone, and
    what is left is float32 rounding of kernels run on another number of rows (measured: exactly 0).
    InternVL encodes every frame as its own tile. A failing bound means a group would see another's pixels.
    """
    proc = load_video_processor(str(checkpoints[family]))
    video = proc.preprocess(
        clip(17, 97, 61), proc.sample(17, 25.0, num_frames=7 if family != "qwen2_vl" else 8)
    )
    run = towers[family]
    whole, whole_deep = run(video.pixel_values_videos, torch.tensor([video.video_grid_thw]))
    parts = [run(g.pixel_values, torch.tensor([g.grid_thw])) for g in proc.groups(video)]
    assert len(parts) == video.video_grid_thw[0] > 1
    assert whole.shape[0] == video.num_tokens
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole, rtol=0, atol=1e-6)
    for layer, deep in enumerate(whole_deep):
        torch.testing.assert_close(torch.cat([p[1][layer] for p in parts]), deep, rtol=0, atol=1e-6)
    assert len(whole_deep) == (2 if family == "qwen3_vl" else 0)


@pytest.mark.parametrize(
    ("family", "class_name"), [("qwen2_5_vl", "Qwen2VLVideoProcessor"), ("qwen3_vl", "Qwen3VLVideoProcessor")]
)
def test_published_defaults_equal_transformers_class_defaults(family, class_name):
    """No checkpoint: the family's defaults (a frame grown to 128 tokens for Qwen2.5-VL, 768 tokens over all
    frames for Qwen3-VL) under the default budgets give transformers' pixels."""
    import transformers

    proc = load_video_processor(family, Config().visual_batch_max_tokens, Config().max_video_tokens)
    ref = getattr(transformers, class_name)()
    frames = clip(61, 320, 240)
    video = proc.preprocess(frames, proc.sample(61, NTSC, fps=2))
    out = ref(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], video_metadata=[{"total_num_frames": 61, "fps": NTSC}],
              do_sample_frames=True, fps=2, num_frames=None, cap_pixels_per_frame=False, return_metadata=True,
              return_tensors="pt")  # fmt: skip
    assert list(out["video_metadata"][0].frames_indices) == list(video.frame_indices)
    assert out["video_grid_thw"].tolist() == [list(video.video_grid_thw)]
    assert torch.equal(out["pixel_values_videos"], video.pixel_values_videos)
    assert not video.plan.clamped
