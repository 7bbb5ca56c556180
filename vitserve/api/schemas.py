"""Request and response bodies of the HTTP API (docs/api.md), as pydantic models.

The JSON request is validated with these models (unknown fields -> 400 invalid_request); the response
models exist for /openapi.json and /docs, the handler builds plain dicts of the same shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vitserve.errors import InvalidRequest

REQUEST_ID_MAX_CHARS = 256


class ImageInput(BaseModel):
    """One image: base64 of the file's bytes, or a URL (only with --allow_image_urls)."""

    model_config = ConfigDict(extra="forbid")
    b64: str | None = Field(None, description="base64 (standard alphabet) of the image file's bytes")
    url: str | None = Field(None, description="http(s) URL; refused unless --allow_image_urls")

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageInput:
        if (self.b64 is None) == (self.url is None):
            raise ValueError("each image or video needs exactly one of 'b64' or 'url'")
        return self


class VideoInput(ImageInput):
    """One video: base64 or URL, and how to sample it (at most one of fps, num_frames; neither: the
    checkpoint's default, docs/video.md)."""

    fps: float | None = Field(None, gt=0, description="frames per second to sample")
    num_frames: int | None = Field(None, ge=1, description="frames to sample, evenly spread")


class EncodeJSONRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(None, min_length=1, max_length=REQUEST_ID_MAX_CHARS)
    images: list[ImageInput] = Field(
        default_factory=list, description="in order; the response lists them in the same order"
    )
    videos: list[VideoInput] = Field(default_factory=list, description="in order, after the images")
    return_embeddings: bool = False


class EncodeMultipartRequest(BaseModel):
    """Documentation only: the multipart form /encode accepts."""

    images: list[bytes] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "string", "format": "binary"}}
    )
    videos: list[bytes] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "string", "format": "binary"}}
    )
    fps: float | None = Field(None, description="applies to every video of the request")
    num_frames: int | None = Field(None, description="applies to every video of the request")
    request_id: str | None = None
    return_embeddings: bool = False


class TensorB64(BaseModel):
    dtype: str = Field(..., description="float32 | float16 | bfloat16")
    shape: list[int]
    b64: str = Field(..., description="little-endian, C-contiguous bytes, base64")


class ImageOut(BaseModel):
    index: int
    image_id: str = Field(..., description="hex sha256 of the image bytes as received")
    num_tokens: int
    grid_thw: list[int]
    original_size: list[int] = Field(..., description="[width, height] as decoded, after EXIF orientation")
    resized_size: list[int] = Field(..., description="[width, height] fed to the encoder")
    clamped: bool
    cached: bool
    delivered: bool = Field(
        ...,
        description="the LLM receiver acknowledged this image (docs/wire.md); always false without --llm_endpoint",
    )
    embedding: TensorB64 | None = Field(None, description="only with return_embeddings")
    deepstack: list[TensorB64] | None = Field(
        None, description="only with return_embeddings, for models that have it"
    )


class VideoOut(BaseModel):
    index: int
    video_id: str = Field(..., description="hex sha256 of the video bytes as received")
    source_fps: float | None
    total_frames: int
    duration_s: float
    frame_indices: list[int] = Field(..., description="the frames sampled, 0-based in presentation order")
    sampled_fps: float
    grid_thw: list[int] = Field(..., description="[T temporal groups, h, w] patches before merge")
    num_tokens: int
    resized_size: list[int] = Field(..., description="[width, height] of every frame fed to the encoder")
    clamped: bool
    cached: bool = Field(..., description="every temporal group was a cache hit or another request's encode")
    delivered: bool = Field(..., description="the LLM receiver acknowledged every temporal group's message")
    second_per_grid_t: float | None = Field(None, description="Qwen2.5-VL: seconds per temporal group")
    timestamps_s: list[float] | None = Field(None, description="Qwen3-VL / Qwen3.5: each group's time")
    embedding: TensorB64 | None = Field(None, description="only with return_embeddings: every group's rows")
    deepstack: list[TensorB64] | None = None


class TimingMs(BaseModel):
    decode: float
    preprocess: float
    queue: float
    encode: float
    send: float


class EncodeResponse(BaseModel):
    request_id: str
    model: str
    images: list[ImageOut]
    videos: list[VideoOut] = Field(default_factory=list, description="only when the request had videos")
    timing_ms: TimingMs


class ErrorDetail(BaseModel):
    code: str
    message: str
    image_index: int | None = None
    video_index: int | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def parse_json_request(payload: object) -> EncodeJSONRequest:
    """The JSON body as a model; any schema violation is 400 invalid_request naming the field."""
    try:
        return EncodeJSONRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidRequest(f"invalid JSON body at {where}: {first.get('msg', 'invalid')}") from None
