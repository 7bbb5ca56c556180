"""Video frame sampling (vitserve/video/sampling.py) against transformers' own video processors' sample_frames,
over a grid of clip lengths, frame rates and requests; every setting transformers crashes on is a 400.

The oracle is the ``sample_frames`` method of the video processor transformers builds from the tiny
checkpoint's video_preprocessor_config.json (AutoVideoProcessor), the method its ``__call__`` runs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from transformers import AutoVideoProcessor
from transformers.video_utils import VideoMetadata

from tests.checkpoints import FAMILIES, make_checkpoint, write_video_config
from vitserve.config import Config
from vitserve.errors import ConfigError, InvalidVideoSampling, http_error
from vitserve.families import VIDEO_DEFAULT_FPS
from vitserve.flags import build_config
from vitserve.video import load_video_processor

NTSC = 30000 / 1001  # 29.97 fps
TOTALS = (1, 2, 3, 5, 17, 75, 299, 1000)
SOURCE_FPS = (NTSC, 25.0, 60.0)
FPS = (0.5, 2, 3.3)
NUM_FRAMES = (1, 2, 5, 7, 14, 16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-sampling")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


def _hf_indices(ref, total: int, source_fps: float, **request) -> list[int] | None:
    """transformers' frame indices, or None where it raises."""
    try:
        return [int(i) for i in ref.sample_frames(VideoMetadata(total, fps=source_fps), **request)]
    except (ValueError, TypeError, ZeroDivisionError):
        return None


def _refused_beyond_transformers(sampler: str, total: int, hf: list[int], num_frames: int | None) -> bool:
    """Where transformers' sampler returns but vitserve refuses, by design (docs/processing.md "Video"), besides
    an index past the last frame (transformers' processor then fails): Qwen3-VL repeats frames for num_frames above the video's count, and its resize then raises on fewer
    frames than one temporal group of 2."""
    return sampler == "qwen3" and (len(hf) < 2 or (num_frames is not None and num_frames > total))


@pytest.mark.parametrize("family", FAMILIES)
def test_frame_indices_equal_transformers(checkpoints, family):
    ref = AutoVideoProcessor.from_pretrained(str(checkpoints[family]), local_files_only=True)
    proc = load_video_processor(str(checkpoints[family]))
    sampler = proc.settings.sampling.sampler
    compared = refused = 0
    for total in TOTALS:
        for source_fps in SOURCE_FPS:
            requests = [{"fps": f, "num_frames": None} for f in FPS]
            requests += [{"fps": None, "num_frames": n} for n in NUM_FRAMES]
            for request in requests:
                hf = _hf_indices(ref, total, source_fps, **request)
                if (
                    hf is None
                    or hf[-1] >= total
                    or _refused_beyond_transformers(sampler, total, hf, request["num_frames"])
                ):
                    with pytest.raises(InvalidVideoSampling):
                        proc.sample(total, source_fps, **request)
                    refused += 1
                    continue
                got = proc.sample(total, source_fps, **request)
                assert list(got.frame_indices) == hf, (total, source_fps, request)
                compared += 1
    assert compared > 100
    assert refused > 0  # the 1-frame clip at least


def test_transformers_float_step_past_the_last_frame_is_a_400(checkpoints):
    """torch.arange(0, 17, 17 / 14).int() ends with 17, one past the last frame: transformers' sampler returns
    it and its processor then fails (IndexError); vitserve answers 400 naming the request."""
    ref = AutoVideoProcessor.from_pretrained(str(checkpoints["qwen2_vl"]), local_files_only=True)
    assert _hf_indices(ref, 17, 25.0, num_frames=14)[-1] == 17
    with pytest.raises(IndexError):
        ref(videos=[np.zeros((17, 28, 28, 3), np.uint8)], video_metadata=[{"total_num_frames": 17, "fps": 25.0}],
            do_sample_frames=True, num_frames=14, return_tensors="pt")  # fmt: skip
    with pytest.raises(InvalidVideoSampling, match="num_frames=14 .* past the last frame"):
        load_video_processor(str(checkpoints["qwen2_vl"])).sample(17, 25.0, num_frames=14)


@pytest.mark.parametrize("family", FAMILIES)
def test_fps_and_num_frames_together_is_a_400(checkpoints, family):
    proc = load_video_processor(str(checkpoints[family]))
    with pytest.raises(InvalidVideoSampling, match="give one of them") as info:
        proc.sample(75, 25.0, fps=2, num_frames=8)
    status, _, body = http_error(info.value)
    assert status == 400
    assert b'"code":"invalid_video_sampling"' in body


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("source_fps", [None, 0.0, -25.0, math.nan, math.inf])
def test_a_missing_source_fps_is_a_400(checkpoints, family, source_fps):
    """transformers raises for Qwen2-VL and InternVL and silently assumes 24 fps for Qwen3-VL (and for
    Qwen2.5-VL's second_per_grid_ts): vitserve refuses with either request."""
    proc = load_video_processor(str(checkpoints[family]))
    for request in ({"fps": 2}, {"num_frames": 4}, {}):
        with pytest.raises(InvalidVideoSampling, match="frame rate is unknown"):
            proc.sample(75, source_fps, **request)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "request_",
    [{"fps": 0}, {"fps": -1}, {"fps": math.nan}, {"num_frames": 0}, {"num_frames": 76}, {"num_frames": 2.5}],
)
def test_impossible_requests_are_a_400(checkpoints, family, request_):
    proc = load_video_processor(str(checkpoints[family]))
    with pytest.raises(InvalidVideoSampling):
        proc.sample(75, 25.0, **request_)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "internvl"])
def test_a_one_frame_clip_is_a_400_where_transformers_crashes(checkpoints, family):
    """One frame cannot fill a temporal group of 2: transformers raises (ZeroDivisionError in Qwen2-VL's
    sampler, ValueError in Qwen3-VL's resize); vitserve answers 400 naming the group size."""
    proc = load_video_processor(str(checkpoints[family]))
    for request in ({"fps": 2}, {"num_frames": 1}, {}):
        with pytest.raises(InvalidVideoSampling, match="groups of 2"):
            proc.sample(1, NTSC, **request)


def test_a_one_frame_clip_samples_for_internvl(checkpoints):
    """InternVL's frames are separate tiles: one frame is a video, with num_frames=1; at fps 2 a 1-frame clip
    at 29.97 fps yields int(0.067) = 0 frames, where transformers divides by zero: a 400."""
    proc = load_video_processor(str(checkpoints["internvl"]))
    assert proc.sample(1, NTSC, num_frames=1).frame_indices == (0,)
    with pytest.raises(InvalidVideoSampling, match="fps=2"):
        proc.sample(1, NTSC, fps=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_fps_is_the_checkpoints_else_2(tmp_path, family):
    ckpt = make_checkpoint(family, tmp_path / "c")
    assert load_video_processor(str(ckpt)).settings.sampling.default_fps == VIDEO_DEFAULT_FPS == 2.0
    write_video_config(family, ckpt, fps=1)
    proc = load_video_processor(str(ckpt))
    assert proc.settings.sampling.default_fps == 1.0
    assert proc.sample(300, 25.0) == proc.sample(300, 25.0, fps=1)
    assert proc.sample(300, 25.0) != proc.sample(300, 25.0, fps=2)


def test_max_video_tokens_flag():
    assert Config().max_video_tokens == 16384
    assert build_config([], {}).max_video_tokens == 16384
    assert build_config(["--max_video_tokens", "4,096"], {}).max_video_tokens == 4096
    assert build_config([], {"VITSERVE_MAX_VIDEO_TOKENS": "0"}).max_video_tokens == 0
    with pytest.raises(ConfigError, match="--max_video_tokens must be >= 0"):
        build_config(["--max-video-tokens", "-1"], {})


def test_fewer_decoded_frames_than_sampled_is_a_400(checkpoints):
    """A decoder that returns fewer frames than were sampled (a truncated file) must not shorten the video."""
    proc = load_video_processor(str(checkpoints["qwen2_5_vl"]))
    sampling = proc.sample(75, 25.0, fps=2)
    frames = np.zeros((len(sampling.frame_indices) - 1, 56, 56, 3), np.uint8)
    with pytest.raises(InvalidVideoSampling, match="never encoded short"):
        proc.preprocess(frames, sampling)
    with pytest.raises(InvalidVideoSampling, match="uint8"):
        proc.preprocess(np.zeros((len(sampling.frame_indices), 56, 56, 3), np.float32), sampling)


@pytest.mark.parametrize(
    ("family", "class_name"),
    [
        ("qwen2_vl", "Qwen2VLVideoProcessor"),
        ("qwen3_vl", "Qwen3VLVideoProcessor"),
        ("qwen3_5", "Qwen3VLVideoProcessor"),
    ],
)
def test_the_registry_defaults_are_transformers_class_defaults(family, class_name):
    """Without a checkpoint (or a video config) the limits are transformers' own class defaults, which the
    registry copies because their module needs torchvision to import."""
    import transformers

    hf = getattr(transformers, class_name)
    settings = load_video_processor(family).settings
    assert (settings.min_pixels, settings.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert (settings.sampling.min_frames, settings.sampling.max_frames) == (hf.min_frames, hf.max_frames)
    assert settings.sampling.default_fps == (getattr(hf, "fps", None) or VIDEO_DEFAULT_FPS)
    assert (settings.patch_size, settings.temporal_patch_size) == (hf.patch_size, hf.temporal_patch_size)
    assert settings.image_mean == pytest.approx(hf.image_mean)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"patch_size": 16}, "differ from the image processor"),
        ({"resample": 2}, "bicubic"),
        ({"do_resize": False}, "bicubic"),
    ],
)
def test_video_configs_vitserve_cannot_reproduce_are_refused_at_start_up(tmp_path, overrides, message):
    ckpt = make_checkpoint("qwen2_vl", tmp_path / "c")
    write_video_config("qwen2_vl", ckpt, **overrides)
    with pytest.raises(ConfigError, match=message):
        load_video_processor(str(ckpt))
