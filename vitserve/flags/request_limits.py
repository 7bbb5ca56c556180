"""The flags that bound what one request may carry and how its media are decoded: images per request, body
and pixel limits, the video limits and decoder processes, the deadline, the resize and the JPEG draft."""

from __future__ import annotations

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags.spec import Flag, check_positive, parse_bool, parse_int, parse_size

# Each video decoder is a process that may map up to 4 GiB (vitserve/video/decoder_pool.py): more than this many is a
# typo on any machine, not a setting.
MAX_VIDEO_DECODERS = 64
MEDIA: dict[str, Flag] = {
    "max_images_per_request": Flag(parse_int, "budget and limits", "more images in one request -> 400"),
    "max_request_bytes": Flag(
        parse_size, "budget and limits", "larger body -> 413 (accepts sizes like 64MiB)"
    ),
    "max_image_pixels": Flag(
        parse_int, "budget and limits", "decoded width x height above this -> 413 (checked from the header)"
    ),
    "max_video_bytes": Flag(
        parse_size, "budget and limits", "larger video -> 413 (accepts sizes like 256MiB)"
    ),
    "max_video_duration_s": Flag(
        float, "budget and limits", "longer video -> 413 (checked from the container before decoding)"
    ),
    "max_video_frames": Flag(
        parse_int,
        "budget and limits",
        "a video with more frames -> 413 (counted by demuxing, before decoding)",
    ),
    "video_decoders": Flag(
        parse_int,
        "budget and limits",
        f"video decoder processes: videos decoded at a time, the rest wait (1..{MAX_VIDEO_DECODERS}); "
        "0 = this server takes no videos",
    ),
    "request_timeout_s": Flag(float, "budget and limits", "end-to-end deadline (504 after it)"),
    "image_resize": Flag(
        str,
        "budget and limits",
        "auto | torch | pil: whose pixels the embeddings equal; torch (= auto) is transformers' torchvision "
        "processor, which vLLM and SGLang use; pil its PIL processor (docs/processing.md)",
    ),
    "jpeg_draft": Flag(
        parse_bool,
        "budget and limits",
        "faster but NOT exact: decode big JPEGs at 1/2-1/8 scale when the budget clamp "
        "shrinks them anyway (docs/jpeg_draft.md)",
    ),
}


def validate(config: Config) -> None:
    check_positive(
        config,
        "max_images_per_request",
        "max_request_bytes",
        "max_image_pixels",
        "max_video_bytes",
        "max_video_duration_s",
        "max_video_frames",
        "request_timeout_s",
    )
    if not 0 <= config.video_decoders <= MAX_VIDEO_DECODERS:
        raise ConfigError(
            f"--video_decoders must be 0..{MAX_VIDEO_DECODERS} (0: no videos), got {config.video_decoders}"
        )
    if config.image_resize not in ("auto", "torch", "pil"):
        raise ConfigError(f"--image_resize {config.image_resize!r} is not one of auto, torch, pil")
