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
            raise ValueError("each image needs exactly one of 'b64' or 'url'")
        return self


class EncodeJSONRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(None, min_length=1, max_length=REQUEST_ID_MAX_CHARS)
    images: list[ImageInput] = Field(..., description="in order; the response lists them in the same order")
    return_embeddings: bool = False


class EncodeMultipartRequest(BaseModel):
    """Documentation only: the multipart form /encode accepts."""

    images: list[bytes] = Field(..., json_schema_extra={"items": {"type": "string", "format": "binary"}})
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
    timing_ms: TimingMs


class ErrorDetail(BaseModel):
    code: str
    message: str
    image_index: int | None = None


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
