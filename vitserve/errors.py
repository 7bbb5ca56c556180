"""Typed errors. Each carries its HTTP status and a stable code (docs/api.md); exactly one handler maps them.

Third-party failures (PIL, HF processors, zmq) are re-raised as one of these with `raise ... from exc`.
Messages name the limit and the flag that sets it.
"""

from __future__ import annotations

import json
import math
from typing import Any


class VitserveError(Exception):
    """Base of every error vitserve reports to a client."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, image_index: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.image_index = image_index
        self.video_index: int | None = None
        self.retry_after_s = retry_after_s

    def with_index(self, image_index: int) -> VitserveError:
        """The same error, attributed to one image of a request."""
        self.image_index = image_index
        return self

    def with_video_index(self, video_index: int) -> VitserveError:
        """The same error, attributed to one video of a request."""
        self.video_index = video_index
        return self

    def to_body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.image_index is not None:
            err["image_index"] = self.image_index
        if self.video_index is not None:
            err["video_index"] = self.video_index
        return {"error": err}


def http_error(err: VitserveError) -> tuple[int, dict[str, str], bytes]:
    """The one rendering of an error as HTTP: (status, headers, JSON body). Every 503 queue_full carries
    Retry-After in whole seconds (at least 1)."""
    headers = {"content-type": "application/json"}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(err.retry_after_s)))
    body = json.dumps(err.to_body(), ensure_ascii=False, separators=(",", ":")).encode()
    return err.status, headers, body


class InvalidRequest(VitserveError):
    status, code = 400, "invalid_request"


class InvalidImage(VitserveError):
    status, code = 400, "invalid_image"


class UnsupportedImage(InvalidImage):
    """A well-formed file in an allowed format whose codec this build cannot decode (e.g. WebP-in-TIFF).

    A subclass of InvalidImage: every handler of bad images handles it; only the code tells them apart."""

    status, code = 400, "unsupported_image"


class InvalidVideoSampling(VitserveError):
    """A video sampling setting transformers crashes on or leaves ambiguous (fps together with num_frames, no
    source fps, fewer frames than one temporal group, more frames asked than the video has): the message
    names the setting (docs/processing.md "Video")."""

    status, code = 400, "invalid_video_sampling"


class InvalidVideo(VitserveError):
    """Not a decodable video: corrupt or truncated data, no video stream, fewer frames decoded than asked, or
    a decoder that crashed on it (docs/processing.md "Decoding")."""

    status, code = 400, "invalid_video"


class UnsupportedVideo(InvalidVideo):
    """A container or codec outside the allowlist (MP4, MOV, MKV, WebM; H.264, H.265, VP8, VP9, AV1), or one
    this build's decoder lacks: the message names it. 400 as SPEC §9 says, a subclass of InvalidVideo."""

    status, code = 400, "unsupported_video"


class VideoDecodeTimeout(VitserveError):
    """A video decoder that ran past its wall deadline or its CPU limit: it was killed and replaced."""

    status, code = 504, "video_decode_timeout"


class ImageTooSmall(VitserveError):
    status, code = 400, "image_too_small"


class AspectRatioTooLarge(VitserveError):
    status, code = 400, "aspect_ratio_too_large"


class TooManyImages(VitserveError):
    status, code = 400, "too_many_images"


class UrlNotAllowed(VitserveError):
    status, code = 400, "url_not_allowed"


class Unauthorized(VitserveError):
    status, code = 401, "unauthorized"


class PayloadTooLarge(VitserveError):
    status, code = 413, "payload_too_large"


class OverTokenBudget(VitserveError):
    status, code = 413, "over_token_budget"


class QueueFull(VitserveError):
    status, code = 503, "queue_full"


class NotReady(VitserveError):
    status, code = 503, "not_ready"


class EncoderFailed(VitserveError):
    status, code = 503, "encoder_failed"


class Timeout(VitserveError):
    status, code = 504, "timeout"


class LLMTimeout(Timeout):
    """The LLM receiver (--llm_endpoint) did not acknowledge an image before the request deadline, or the
    LLM server behind the front door (--llm_url) did not answer within --llm_timeout_s."""

    status, code = 504, "llm_timeout"


class LLMUnavailable(VitserveError):
    """The LLM server behind the front door (--llm_url) cannot be reached, or dropped the connection."""

    status, code = 502, "llm_unavailable"


# OpenAI's error `type` by status class, for the front door's own errors (docs/vllm.md).
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error"}


def openai_error(err: VitserveError, param: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """The front door's rendering of an error, in OpenAI's shape: {"error": {"message", "type", "code",
    "param"}}, with vitserve's stable code in `code` (the same codes as /encode's) and the JSON path of the
    part at fault in `param`. Headers as http_error's (Retry-After on queue_full)."""
    status, headers, _ = http_error(err)
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    if param is None and err.image_index is not None:
        param = f"image {err.image_index}"
    if param is None and err.video_index is not None:
        param = f"video {err.video_index}"
    body = {"error": {"message": err.message, "type": kind, "code": err.code, "param": param}}
    return status, headers, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class ConfigError(Exception):
    """A start-up setting that cannot work; the message names the flag to change."""


class MemoryTargetError(ConfigError):
    """--visual_mem_gb cannot be met (no budget fits it, or --visual_batch_max_tokens's does not): exit 2 with
    the one diagnostic line a rank raised, which names every knob (docs/engine.md)."""
