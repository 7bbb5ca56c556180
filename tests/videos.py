"""Synthetic video clips made with PyAV, whose frames carry their own number in the pixels.

Frame k holds k in binary as a row of BITS black or white cells across its lower half (readable after lossy
coding and after a resize: ``frame_number``) above a pattern that moves with k, so that neighbouring frames
differ everywhere. Clips: H.264 in MP4 (B-frames, a keyframe every ``gop`` frames), H.264 in MKV, VP9 and VP8
in WebM, H.265 in MP4, AV1 in WebM, at any frame rate (29.97 by default).
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

from vitserve.contract import VideoMetadata

NTSC = Fraction(30000, 1001)  # 29.97 fps
BITS = 10  # frame numbers up to 1023
# (container format, encoder) per kind of clip: every codec vitserve accepts
KINDS = {
    "mp4": ("mp4", "libx264"),
    "mkv": ("matroska", "libx264"),
    "webm": ("webm", "libvpx-vp9"),
    "webm_vp8": ("webm", "libvpx"),
    "hevc": ("mp4", "libx265"),
    "av1": ("webm", "libsvtav1"),
}
_VPX = {"deadline": "realtime", "cpu-used": "8", "crf": "20", "b": "0"}
_OPTIONS = {
    "libvpx": _VPX,
    "libvpx-vp9": _VPX,
    "libx265": {"preset": "ultrafast", "crf": "20", "x265-params": "log-level=error"},
    "libsvtav1": {"preset": "12", "crf": "30"},
}


def frame_pixels(k: int, width: int = 160, height: int = 96) -> np.ndarray:
    """(height, width, 3) uint8: frame k's picture."""
    ys, xs = np.mgrid[0:height, 0:width]
    out = np.empty((height, width, 3), np.uint8)
    out[..., 0] = (xs * 3 + k * 7) % 256
    out[..., 1] = (ys * 5 + k * 11) % 256
    out[..., 2] = ((xs + ys) * 2 + k * 13) % 256
    cell = width // BITS
    for bit in range(BITS):
        out[height // 2 :, bit * cell : (bit + 1) * cell] = 255 if (k >> bit) & 1 else 0
    return out


def frame_number(pixels: np.ndarray) -> int:
    """The number frame_pixels wrote, read back from an (H, W, 3) frame at any size: each cell's centre."""
    height, width = pixels.shape[:2]
    row = pixels[height * 3 // 4].astype(np.int32).mean(axis=-1)  # (W,) the middle of the lower half
    cell = width / BITS
    return sum(1 << bit for bit in range(BITS) if row[int((bit + 0.5) * cell)] > 128)


def make_clip(
    frames: int,
    kind: str = "mp4",
    fps: Fraction = NTSC,
    size: tuple[int, int] = (160, 96),
    gop: int = 12,
    preset: str = "veryfast",
) -> bytes:
    """The encoded clip: ``frames`` frames of ``size`` = (width, height) at ``fps``, a keyframe every ``gop``;
    ``preset``: x264's (veryfast has B-frames, so decode order differs from display order; ultrafast has none
    and encodes big clips quickly)."""
    fmt, encoder = KINDS[kind]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(encoder, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        stream.options = {"preset": preset, "crf": "18"} if encoder == "libx264" else _OPTIONS[encoder]
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(k, *size), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def reference_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of the clip by PyAV's straightforward decode, as transformers' loader converts them."""
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


# a length-prefixed H.264 end-of-sequence NAL: a packet that decodes to no frame
END_OF_SEQUENCE = b"\x00\x00\x00\x01\x0a"


def with_packet_replaced(data: bytes, which: int, payload: bytes) -> bytes:
    """The Matroska clip remuxed with its ``which``-th video packet (decode order) holding ``payload``."""
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format="matroska") as dst:
        stream = src.streams.video[0]
        copy = dst.add_stream_from_template(stream)
        packets = [packet for packet in src.demux(stream) if packet.size]
        for index, packet in enumerate(packets):
            if index == which:
                replaced = av.Packet(payload)
                replaced.pts, replaced.dts, replaced.time_base = packet.pts, packet.dts, packet.time_base
                packet = replaced
            packet.stream = copy
            dst.mux(packet)
    return out.getvalue()


def mutants(data: bytes, count: int, seed: int) -> list[bytes]:
    """Truncations (every third) and 1-8 bit flips of ``data``, after its first 12 bytes so that the container
    is still recognised: the decoder pool's fuzz test and the server's (tests/e2e/test_video_fuzz.py)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 3 == 0:
            out.append(data[: int(rng.integers(12, len(data)))])
            continue
        blob = bytearray(data)
        for _ in range(int(rng.integers(1, 9))):
            at = int(rng.integers(12, len(blob)))
            blob[at] ^= 1 << int(rng.integers(0, 8))
        out.append(bytes(blob))
    return out


def video_metadata(grid_thw: tuple[int, int, int], video_id: str = "v", **fields: object) -> VideoMetadata:
    """A prepared video's metadata for a test that needs only its grid (and a family's time field, in
    `fields`): the sampling fields are placeholders, one frame per group."""
    t, h, w = grid_thw
    defaults: dict[str, object] = {
        "source_fps": 2.0,
        "total_frames": t,
        "duration_s": t / 2.0,
        "frame_indices": tuple(range(t)),
        "sampled_fps": 2.0,
        "num_tokens": t * h * w // 4,
        "resized_size": (w * 14, h * 14),
        "clamped": False,
    }
    return VideoMetadata(video_id=video_id, grid_thw=grid_thw, **{**defaults, **fields})  # type: ignore[arg-type]
