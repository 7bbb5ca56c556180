"""Video decoding (vitserve/video/decode.py) against PyAV's straightforward decode of every frame.

Clips are real H.264/VP9/VP8 files made with PyAV (tests/videos.py) whose frames carry their own number in the
pixels. The oracle decodes every frame in order and converts it as transformers' PyAV loader does
(``to_ndarray(format="rgb24")``); vitserve's seeking decode must give the same bytes for any set of indices,
and after its resize the bytes of the torch resize of the oracle's frame. The pool that isolates this code is
tested in tests/integration/test_video_decoder_pool.py.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from tests.videos import (
    END_OF_SEQUENCE,
    KINDS,
    NTSC,
    frame_number,
    make_clip,
    reference_frames,
    with_packet_replaced,
)
from vitserve.config import Config
from vitserve.errors import ConfigError, InvalidVideo, PayloadTooLarge, UnsupportedVideo
from vitserve.flags import build_config
from vitserve.processors.pixels import resize_uint8
from vitserve.video import decode
from vitserve.video.decode import VideoLimits, decode_frames, probe

LIMITS = VideoLimits()
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """31 frames (odd) at 29.97 fps of every kind, a keyframe every 12 frames, B-frames in H.264."""
    return {kind: make_clip(31, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def references(clips) -> dict[str, list[np.ndarray]]:
    return {kind: reference_frames(data) for kind, data in clips.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_probe_counts_frames_by_demuxing(kind, clips, references):
    """MKV and WebM headers carry no frame count (PyAV's stream.frames is 0): the count is demuxed."""
    info = probe(clips[kind], LIMITS)
    assert info.total_frames == len(references[kind]) == 31
    assert [frame_number(f) for f in references[kind]] == list(range(31))  # the clip is what it claims
    assert info.fps == pytest.approx(float(NTSC), rel=1e-3)
    assert info.duration_s == pytest.approx(31 / info.fps)
    assert (info.width, info.height) == (160, 96)
    codecs = {"mp4": "h264", "mkv": "h264", "webm": "vp9", "webm_vp8": "vp8", "hevc": "hevc", "av1": "av1"}
    assert info.codec == codecs[kind]
    assert info.container == {"mkv": "matroska", "webm": "webm", "webm_vp8": "webm", "av1": "webm"}.get(
        kind, "mp4"
    )
    if info.container != "mp4":
        with av.open(io.BytesIO(clips[kind])) as container:
            assert container.streams.video[0].frames == 0  # why the count is demuxed


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_decoded_frames_equal_a_straight_decode(kind, threads, clips, references):
    """Any indices (across keyframes, backwards, repeated): the oracle's bytes, in the order asked, with one
    decoding thread and with the decoder pool's two (frame threads: a skipped packet's setting travels with it)."""
    rng = np.random.default_rng(0)
    index_sets = [[0], [30], list(range(31)), [0, 12, 24, 30], [5, 6, 7, 13, 29], [29, 3, 3, 17]]
    index_sets += [sorted(rng.choice(31, size=int(rng.integers(1, 12)), replace=False)) for _ in range(6)]
    for indices in index_sets:
        frames = decode_frames(clips[kind], indices, None, LIMITS, threads)
        assert frames.shape == (len(indices), 96, 160, 3)
        assert frames.dtype == np.uint8
        for frame, index in zip(frames, indices, strict=True):
            np.testing.assert_array_equal(frame, references[kind][index], err_msg=f"{kind} frame {index}")


@pytest.mark.parametrize("kind", ["mp4", "webm"])
def test_frames_are_resized_where_they_are_decoded(kind, clips, references):
    """The torch uint8 bicubic antialias resize of the oracle's frame, and the frame's number still readable."""
    indices = [1, 10, 19, 28]
    for size in ((80, 48), (224, 140)):
        frames = decode_frames(clips[kind], indices, size, LIMITS)
        assert frames.shape == (4, size[1], size[0], 3)
        for frame, index in zip(frames, indices, strict=True):
            np.testing.assert_array_equal(frame, resize_uint8(references[kind][index], size))
            assert frame_number(frame) == index


def test_seeking_over_many_keyframes():
    """A keyframe every 5 frames and B-frames between: sampled frames across 25 keyframes."""
    data = make_clip(125, "mp4", fps=Fraction(25), gop=5)
    reference = reference_frames(data)
    assert probe(data, LIMITS).total_frames == len(reference) == 125
    for indices in ([0, 12, 25, 37, 50, 62, 75, 87, 100, 112], list(range(3, 125, 9)), [124, 0, 60]):
        frames = decode_frames(data, indices, None, LIMITS)
        for frame, index in zip(frames, indices, strict=True):
            np.testing.assert_array_equal(frame, reference[index])


def test_seeks_only_when_a_keyframe_lies_between(monkeypatch):
    """Sparse indices each seek to their keyframe; indices inside one keyframe interval decode on."""
    data = make_clip(125, "mp4", fps=Fraction(25), gop=5)
    seeks: list[int] = []
    real_seek = decode._seek

    def counting_seek(container, stream, pts, keep):
        seeks.append(pts)
        return real_seek(container, stream, pts, keep)

    monkeypatch.setattr(decode, "_seek", counting_seek)
    decode_frames(data, [0, 1, 2, 3, 4], None, LIMITS)
    assert len(seeks) == 1  # one interval: one seek to its keyframe, then decoding on
    seeks.clear()
    decode_frames(data, list(range(2, 125, 10)), None, LIMITS)
    assert len(seeks) == 13  # a keyframe between every two targets
    assert len(set(seeks)) == 13


@pytest.mark.parametrize(("kind", "skips"), [("mp4", True), ("hevc", True), ("webm", False), ("av1", False)])
def test_non_reference_frames_between_targets_are_not_decoded(kind, skips, clips, references, monkeypatch):
    """H.264/H.265: the B-frames no frame refers to are dropped unless asked for, and the asked ones (B-frames
    among them) still equal the straight decode; other codecs decode every frame up to the last target."""
    decoded: list[int] = []
    real = decode._decode_kept

    def counting(container, stream, keep):
        for frame in real(container, stream, keep):
            decoded.append(frame.pts)
            yield frame

    monkeypatch.setattr(decode, "_decode_kept", counting)
    indices = [1, 2, 3, 9, 10, 11]  # one keyframe interval (12): a single pass from frame 0
    frames = decode_frames(clips[kind], indices, None, LIMITS)
    for frame, index in zip(frames, indices, strict=True):
        np.testing.assert_array_equal(frame, references[kind][index])
    if skips:
        assert 7 <= len(decoded) < 12  # the references (frame 0 and the P/reference B-frames) and the asked
    else:
        assert len(decoded) >= 12  # frames 0..11, and whatever the decoder had in flight


def test_one_frame_clip():
    data = make_clip(1, "mp4")
    info = probe(data, LIMITS)
    assert info.total_frames == 1
    frames = decode_frames(data, [0], (32, 32), LIMITS)
    assert frames.shape == (1, 32, 32, 3)
    assert frame_number(frames[0]) == 0


def test_indices_outside_the_video_are_refused(clips):
    with pytest.raises(InvalidVideo, match="of a video of 31 frames"):
        decode_frames(clips["mp4"], [0, 31], None, LIMITS)


@pytest.mark.parametrize(
    ("limits", "flag"),
    [
        (VideoLimits(max_bytes=1000), "--max_video_bytes=1000"),
        (VideoLimits(max_frames=30), "--max_video_frames=30"),
        (VideoLimits(max_duration_s=1.0), "--max_video_duration_s=1"),
        (VideoLimits(max_pixels=160 * 96 - 1), "--max_image_pixels=15359"),
    ],
)
@pytest.mark.parametrize("kind", ["mp4", "mkv"])
def test_limits_are_refused_before_decoding(limits, flag, kind, clips, monkeypatch):
    """413 naming the flag, from the header or the demuxed count: no frame is decoded."""

    def no_decoding(*args, **kwargs):
        raise AssertionError("a frame was decoded before the limits were checked")

    monkeypatch.setattr(decode, "_decode_seeking", no_decoding)
    monkeypatch.setattr(decode, "_decode_all", no_decoding)
    for call in (lambda: probe(clips[kind], limits), lambda: decode_frames(clips[kind], [0], None, limits)):
        with pytest.raises(PayloadTooLarge, match=flag) as err:
            call()
        assert err.value.status == 413
    assert probe(clips[kind], LIMITS).total_frames == 31  # the same clip under the defaults


def test_limit_flags():
    config = Config()
    assert (config.max_video_bytes, config.max_video_duration_s, config.max_video_frames) == (
        256 * 1024 * 1024,
        3600.0,
        36_000,
    )
    config = build_config(
        ["--max_video_bytes", "1MiB", "--max_video_duration_s", "60", "--max_video_frames", "1,800"],
        {"VITSERVE_MAX_IMAGE_PIXELS": "1000000"},
    )
    assert VideoLimits.from_config(config) == VideoLimits(1024 * 1024, 60.0, 1800, 1_000_000)
    assert build_config([], {"VITSERVE_MAX_VIDEO_FRAMES": "10"}).max_video_frames == 10
    for flag in ("--max_video_bytes", "--max_video_duration_s", "--max_video_frames"):
        with pytest.raises(ConfigError, match=f"{flag} must be > 0"):
            build_config([flag, "0"], {})


def _one_black_frame(container_format: str, codec: str, pix_fmt: str, rate: int) -> bytes:
    """A 32x32 one-frame clip in a container or codec vitserve refuses (GIF, MPEG-4 Part 2 in MP4)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = 32, 32, pix_fmt
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buf.getvalue()


def _gif() -> bytes:
    return _one_black_frame("gif", "gif", "rgb8", 10)


def _mpeg4_in_mp4() -> bytes:
    return _one_black_frame("mp4", "mpeg4", "yuv420p", 25)


def test_unsupported_containers_and_codecs_name_what_they_are():
    with pytest.raises(UnsupportedVideo, match="not an MP4, MOV, MKV or WebM") as err:
        probe(_gif(), LIMITS)
    assert err.value.status == 400
    assert err.value.code == "unsupported_video"
    with pytest.raises(UnsupportedVideo, match="'mpeg4'"):
        probe(_mpeg4_in_mp4(), LIMITS)


@pytest.mark.parametrize("kind", ["mp4", "mkv", "webm"])
def test_corrupt_and_truncated_inputs_are_400s(kind, clips):
    """Bytes that are no video, cut short, or damaged: InvalidVideo (or a 413), never another exception."""
    data = clips[kind]
    rng = np.random.default_rng(1)
    inputs = [b"", data[:11], bytes(rng.integers(0, 256, 5000, dtype=np.uint8)), data[:8] + bytes(4000)]
    inputs += [data[: len(data) * k // 8] for k in range(1, 8)]
    for blob in inputs:
        _only_errors_or_whole(blob)


def _only_errors_or_whole(blob: bytes) -> None:
    """probe + decode every frame: a 400 or 413 (anything else fails the test), or every frame asked."""
    try:
        info = probe(blob, LIMITS)
        frames = decode_frames(blob, range(info.total_frames), None, LIMITS)
    except (InvalidVideo, PayloadTooLarge):
        return
    assert len(frames) == info.total_frames


def test_a_truncated_stream_is_never_returned_short(clips):
    """Cut anywhere: refused (400), or every frame the cut file holds, equal to the straight decode of the same
    bytes; never fewer frames than its count. (A cut file's frames need not be the first of the whole clip's:
    with B-frames, the packets that survive may skip some.)"""
    data = clips["mkv"]  # Matroska: its index is optional, a cut file still demuxes
    refused = decoded = 0
    for cut in range(200, len(data), 97):
        try:
            info = probe(data[:cut], LIMITS)
            frames = decode_frames(data[:cut], range(info.total_frames), None, LIMITS)
        except InvalidVideo:
            refused += 1
            continue
        decoded += 1
        reference = reference_frames(data[:cut])
        assert len(frames) == info.total_frames <= len(reference)
        for frame, index in zip(frames, range(info.total_frames), strict=True):
            np.testing.assert_array_equal(frame, reference[index])
    assert refused > 0
    assert decoded > 0


def test_a_packet_without_a_frame_is_a_400_not_a_shorter_video(clips):
    """The last packet holds no picture (an end-of-sequence NAL): PyAV's straight decode quietly gives 30
    frames for 31; vitserve refuses the video when that frame is asked, and serves the frames before it."""
    data = with_packet_replaced(clips["mkv"], 30, END_OF_SEQUENCE)
    reference = reference_frames(data)
    assert probe(data, LIMITS).total_frames == 31
    assert len(reference) == 30
    with pytest.raises(InvalidVideo, match="30 of the 31 frames asked could be decoded.*never encoded short"):
        decode_frames(data, range(31), None, LIMITS)
    frames = decode_frames(data, [0, 15, 29], None, LIMITS)
    for frame, index in zip(frames, [0, 15, 29], strict=True):
        np.testing.assert_array_equal(frame, reference[index])


@pytest.mark.parametrize("kind", ["mp4", "mkv", "webm"])
def test_chunked_decodes_equal_one_decode(kind, clips):
    """The engine asks for a video's frames a chunk at a time (engine/feed.py): each chunk's call seeks to
    its own frames, and the chunks together are the one-shot decode's bytes, resized included."""
    indices = [0, 2, 5, 7, 11, 12, 13, 19, 24, 25, 29, 30, 30]  # a padded last group repeats its frame
    whole = decode_frames(clips[kind], indices, (84, 56), LIMITS)
    for size in (1, 2, 3, 5):
        chunks = [
            decode_frames(clips[kind], indices[k : k + size], (84, 56), LIMITS) for k in range(0, 13, size)
        ]
        np.testing.assert_array_equal(np.concatenate(chunks), whole, err_msg=f"chunks of {size}")
