"""Video decoding with PyAV: header checks against the limits, frames counted by demuxing, the sampled frames
decoded by seeking through a demuxed pts table and resized where they are decoded (docs/processing.md
"Decoding").

Usage (inside a decoder process: vitserve/video/decoder_pool.py runs these in spawned, rlimited processes)::

    info = probe(data, limits)  # container, codec, size, fps, frames, duration; 413/415/400 before decoding
    frames = decode_frames(data, indices, (width, height), limits)  # (len(indices), height, width, 3) uint8

- Only MP4/MOV and Matroska/WebM are opened, each by its own demuxer after its magic bytes are seen: random
  bytes never reach FFmpeg's format probing. Codecs: H.264, H.265, VP8, VP9, AV1.
- ``stream.frames`` is 0 for Matroska and WebM, and a header can lie: the frame count is the number of the
  video stream's packets (one frame each), demuxed without decoding, and stops at ``--max_video_frames``.
- Frame k is the frame with the k-th smallest pts. A sampled frame is reached by seeking to the keyframe at
  or before its pts when a keyframe lies between the decoder and it, else by decoding on; this equals a
  straight decode of every frame (tests/unit/test_video_decode.py) at a fraction of the work. H.264 and
  H.265 frames that nothing refers to are dropped undecoded on the way unless asked for (``_decode_kept``).
- Frames are converted as transformers' PyAV loader converts them (``to_ndarray(format="rgb24")``) and resized
  with the torch resize of ``--image_resize torch`` (vitserve/processors/pixels.py), so full-size frames
  never leave the decoding process.
- A frame that cannot be decoded makes the whole call fail (400): never a shorter video.
"""

from __future__ import annotations

import bisect
import io
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from vitserve.config import Config
from vitserve.errors import InvalidVideo, PayloadTooLarge, UnsupportedVideo, VitserveError
from vitserve.processors.pixels import resize_uint8

# The video codecs SPEC §9 accepts, by FFmpeg codec (not decoder) name.
CODECS = ("h264", "hevc", "vp8", "vp9", "av1")
# Codecs whose non-reference frames are skipped unless asked for (_decode_kept).
_SKIP_NONREF = ("h264", "hevc")
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")  # a QuickTime file's first box
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska and WebM
# What PyAV and FFmpeg raise on bad data; each becomes InvalidVideo (a decoder crash is the pool's business).
_DECODE_ERRORS = (av.FFmpegError, EOFError, ValueError, IndexError, OverflowError, UnicodeDecodeError)


@dataclass(frozen=True)
class VideoLimits:
    """What a video may cost, each named by its flag in the 413 that refuses it (SPEC §9)."""

    max_bytes: int = Config.max_video_bytes  # --max_video_bytes
    max_duration_s: float = Config.max_video_duration_s  # --max_video_duration_s
    max_frames: int = Config.max_video_frames  # --max_video_frames: frames in the video, demuxed
    max_pixels: int = Config.max_image_pixels  # --max_image_pixels: width x height of a frame

    @classmethod
    def from_config(cls, config: Config) -> VideoLimits:
        return cls(
            max_bytes=config.max_video_bytes,
            max_duration_s=config.max_video_duration_s,
            max_frames=config.max_video_frames,
            max_pixels=config.max_image_pixels,
        )

    def check_bytes(self, size: int) -> None:
        if size > self.max_bytes:
            raise PayloadTooLarge(f"the video is {size} bytes, over --max_video_bytes={self.max_bytes}")

    def check_frame(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise PayloadTooLarge(
                f"video frames are {width}x{height} = {width * height} pixels, over "
                f"--max_image_pixels={self.max_pixels}"
            )

    def check_duration(self, seconds: float) -> None:
        if seconds > self.max_duration_s:
            raise PayloadTooLarge(
                f"the video lasts {seconds:.1f} s, over --max_video_duration_s={self.max_duration_s:g}"
            )

    def check_frames(self, count: int) -> None:
        if count > self.max_frames:
            raise PayloadTooLarge(
                f"the video has more than {self.max_frames} frames, over --max_video_frames={self.max_frames}"
            )


@dataclass(frozen=True)
class VideoInfo:
    """What the container says, checked, with the frame count found by demuxing."""

    container: str  # "mp4", "mov", "matroska" or "webm"
    codec: str  # one of CODECS
    width: int
    height: int
    # the stream's average frame rate, which transformers' PyAV loader reads too; None: unknown
    fps: float | None
    total_frames: int  # video packets demuxed, one frame each
    duration_s: float  # total_frames / fps; the pts span when the fps is unknown


@dataclass(frozen=True)
class _PtsTable:
    """The video stream's packets in presentation order: frame k has pts ``pts[k]``."""

    pts: list[int]  # sorted; empty when some packet has no pts (then frames are counted, never sought)
    keyframes: list[int]  # sorted pts of the keyframes
    count: int
    span_s: float  # last pts - first pts, in seconds

    def keyframe_before(self, pts: int) -> int:
        """The pts of the last keyframe at or before ``pts`` (the first keyframe if none is)."""
        at = bisect.bisect_right(self.keyframes, pts)
        return self.keyframes[max(0, at - 1)]


def _sniff(data: bytes) -> tuple[str, str]:
    """(FFmpeg demuxer, container name) from the magic bytes; UnsupportedVideo for anything else."""
    if len(data) < 12:
        raise InvalidVideo(f"{len(data)} bytes is too short to be a video")
    if len(data) >= 8 and data[4:8] in _MP4_BOXES:
        return "mov", "mov" if data[8:12] == b"qt  " else "mp4"
    if data.startswith(_EBML_MAGIC):
        return "matroska", "webm" if b"webm" in data[:64] else "matroska"
    raise UnsupportedVideo("not an MP4, MOV, MKV or WebM file (the formats vitserve decodes)")


@contextmanager
def _open(data: bytes, limits: VideoLimits) -> Iterator[tuple[Any, Any, str]]:
    """(container, video stream, container name), the header checked against ``limits``."""
    limits.check_bytes(len(data))
    demuxer, name = _sniff(data)
    try:
        container = av.open(io.BytesIO(data), format=demuxer, mode="r")
    except _DECODE_ERRORS as exc:
        raise InvalidVideo(f"not a readable {name} file: {_why(exc)}") from exc
    try:
        if not container.streams.video:
            raise InvalidVideo(f"the {name} file has no video stream")
        stream = container.streams.video[0]
        _check_header(stream, container, limits)
        yield container, stream, name
    finally:
        container.close()


def _check_header(stream: Any, container: Any, limits: VideoLimits) -> None:
    codec = _codec_name(stream) if stream.codec_context else None
    if codec not in CODECS:
        raise UnsupportedVideo(f"video codec {codec!r} is not one of {', '.join(CODECS)}")
    if stream.codec_context.width <= 0 or stream.codec_context.height <= 0:
        raise InvalidVideo("the video stream has no frame size in its header")
    limits.check_frame(stream.codec_context.width, stream.codec_context.height)
    if container.duration is not None:  # AV_TIME_BASE units (microseconds)
        limits.check_duration(container.duration / 1_000_000)
    if stream.frames:  # MP4's sample count; 0 when the container does not say (Matroska, WebM)
        limits.check_frames(stream.frames)


def _codec_name(stream: Any) -> str:
    """The codec's own name ("av1"), not its decoder's ("libdav1d")."""
    return str(stream.codec_context.codec.canonical_name)


def _pts_table(container: Any, stream: Any, limits: VideoLimits) -> _PtsTable:
    """Demux (never decode) the video stream: one entry per frame-carrying packet."""
    pts: list[int | None] = []
    keyframes: list[int] = []
    try:
        for packet in container.demux(stream):
            if packet.size == 0 or packet.is_discard:  # the end-of-stream flush packet, edit-list drops
                continue
            pts.append(packet.pts)
            limits.check_frames(len(pts))
            if packet.is_keyframe and packet.pts is not None:
                keyframes.append(packet.pts)
    except _DECODE_ERRORS as exc:
        raise InvalidVideo(f"the video is corrupt or truncated after {len(pts)} frames: {_why(exc)}") from exc
    if not pts:
        raise InvalidVideo("the video stream holds no frames")
    known = sorted(p for p in pts if p is not None)
    span_s = float((known[-1] - known[0]) * stream.time_base) if known and stream.time_base else 0.0
    seekable = len(known) == len(pts) and len(set(known)) == len(known) and bool(keyframes)
    return _PtsTable(known if seekable else [], sorted(keyframes), len(pts), span_s)


def _info(stream: Any, name: str, table: _PtsTable) -> VideoInfo:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate and math.isfinite(float(rate)) and float(rate) > 0 else None
    return VideoInfo(
        container=name,
        codec=_codec_name(stream),
        width=stream.codec_context.width,
        height=stream.codec_context.height,
        fps=fps,
        total_frames=table.count,
        duration_s=table.count / fps if fps else table.span_s,
    )


def probe(data: bytes, limits: VideoLimits) -> VideoInfo:
    """The video's header, checked against ``limits``, and its frame count by demuxing. Raises
    PayloadTooLarge (413) over a limit, UnsupportedVideo for a container or codec outside the allowlist,
    InvalidVideo for data that does not demux."""
    with _open(data, limits) as (container, stream, name):
        table = _pts_table(container, stream, limits)
        info = _info(stream, name, table)
    limits.check_duration(info.duration_s)
    return info


def decode_frames(
    data: bytes, indices: Sequence[int], size: tuple[int, int] | None, limits: VideoLimits, threads: int = 1
) -> np.ndarray:
    """The frames at ``indices`` (presentation order, 0-based), as (len(indices), height, width, 3) uint8 RGB
    resized to ``size`` = (width, height), or at their own size for None. Every asked frame is decoded or
    InvalidVideo (400) is raised: a video is never returned short."""
    with _open(data, limits) as (container, stream, _name):
        table = _pts_table(container, stream, limits)
        wanted = sorted(set(indices))
        if wanted and (wanted[0] < 0 or wanted[-1] >= table.count):
            raise InvalidVideo(
                f"frame indices {wanted[0]}..{wanted[-1]} asked of a video of {table.count} frames"
            )
        width, height = stream.codec_context.width, stream.codec_context.height
        stream.thread_type = "AUTO"  # frame and slice threads; the output does not depend on them
        stream.codec_context.thread_count = threads
        container.seek(0)  # back to the start after demuxing (and flush the decoder)
        try:
            if not wanted:
                got: Iterator[tuple[int, Any]] = iter(())
            elif table.pts:
                got = _decode_seeking(container, stream, table, wanted)
            else:
                got = _decode_all(container, wanted)
            picked = {index: _convert(frame, (width, height), size, limits) for index, frame in got}
        except _DECODE_ERRORS as exc:
            raise InvalidVideo(f"the video is corrupt or truncated: {_why(exc)}") from exc
        except MemoryError as exc:
            raise InvalidVideo("decoding the video needed more memory than the decoder may use") from exc
    if len(picked) < len(wanted):
        missing = [i for i in wanted if i not in picked]
        raise InvalidVideo(
            f"{len(picked)} of the {len(wanted)} frames asked could be decoded (first missing: frame "
            f"{missing[0]} of {table.count}): a corrupt or truncated video is refused, never encoded short"
        )
    if not indices:
        out_w, out_h = size or (width, height)
        return np.empty((0, out_h, out_w, 3), dtype=np.uint8)
    return np.stack([picked[i] for i in indices])  # (n, h, w, 3) uint8


def _decode_seeking(
    container: Any, stream: Any, table: _PtsTable, wanted: list[int]
) -> Iterator[tuple[int, Any]]:
    """(index, frame) for the wanted indices, in order, stopping at the first that does not decode: seek to
    the keyframe before a target when one lies between the last decoded frame and it, else decode on."""
    frames: Iterator[Any] | None = None
    position: int | None = None  # pts of the last decoded frame; None right after a seek
    keep = frozenset(table.pts[index] for index in wanted)
    for index in wanted:
        target = table.pts[index]
        keyframe = table.keyframe_before(target)
        sought = frames is None or position is None or keyframe > position
        if sought or frames is None:
            frames = _seek(container, stream, keyframe, keep)
        frame, position = _advance(frames, target)
        if frame is None and sought and position is not None and keyframe > table.keyframes[0]:
            # the demuxer's seek landed past the target (an index it lacks): decode from the first keyframe
            frames = _seek(container, stream, table.keyframes[0], keep)
            frame, position = _advance(frames, target)
        if frame is None:
            return
        yield index, frame


def _advance(frames: Iterator[Any], target: int) -> tuple[Any | None, int | None]:
    """Decode on to the frame whose pts is ``target``: (that frame, or None if it never comes out; the pts of
    the last frame decoded, None at the end of the stream)."""
    for frame in frames:
        if frame.pts is None:
            continue
        if frame.pts >= target:
            return (frame if frame.pts == target else None), frame.pts
    return None, None


def _seek(container: Any, stream: Any, pts: int, keep: frozenset[int]) -> Iterator[Any]:
    container.seek(pts, stream=stream, backward=True, any_frame=False)  # flushes the decoder
    return _decode_kept(container, stream, keep)


def _decode_kept(container: Any, stream: Any, keep: frozenset[int]) -> Iterator[Any]:
    """The frames decoded from the demuxer's position on, less the non-reference frames (those no other frame
    is predicted from: most B-frames) whose pts is not in ``keep``: their packets are dropped undecoded
    (FFmpeg's AVDISCARD_NONREF, set per packet), which changes no other frame and saves their decoding.
    Only for H.264 and H.265, where a packet is one frame and "non-reference" is the bitstream's own flag;
    AV1 packets can carry a hidden reference frame beside the shown one, so every other codec decodes all."""
    context = stream.codec_context
    skipping = _codec_name(stream) in _SKIP_NONREF
    for packet in container.demux(stream):
        if skipping:
            context.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in keep else "NONREF"
        yield from packet.decode()


def _decode_all(container: Any, wanted: list[int]) -> Iterator[tuple[int, Any]]:
    """(index, frame) by decoding every frame in order: for streams whose packets lack a pts."""
    targets = set(wanted)
    for index, frame in enumerate(container.decode(video=0)):
        if index > wanted[-1]:
            return
        if index in targets:
            yield index, frame


def _convert(
    frame: Any, header: tuple[int, int], size: tuple[int, int] | None, limits: VideoLimits
) -> np.ndarray:
    """(H, W, 3) uint8 RGB as transformers' PyAV loader converts a frame, resized to ``size``."""
    limits.check_frame(frame.width, frame.height)
    if (frame.width, frame.height) != header:
        raise InvalidVideo(
            f"a frame is {frame.width}x{frame.height} in a video whose header says {header[0]}x{header[1]}"
        )
    rgb = frame.to_ndarray(format="rgb24")  # (H, W, 3) uint8
    return rgb if size is None else resize_uint8(rgb, size)


def _why(exc: BaseException) -> str:
    """FFmpeg's reason without its errno and file name (always '<none>' for bytes)."""
    return (
        str(exc.strerror)
        if isinstance(exc, av.FFmpegError) and exc.strerror
        else str(exc) or type(exc).__name__
    )


def error_reply(exc: BaseException) -> tuple[str, str]:
    """(code, message) of an error raised in a decoder process, for the pool to re-raise as its type."""
    if isinstance(exc, VitserveError):
        return exc.code, exc.message
    if isinstance(exc, MemoryError):
        return InvalidVideo.code, "decoding the video needed more memory than the decoder may use"
    return InvalidVideo.code, f"the video could not be decoded: {type(exc).__name__}: {exc}"
