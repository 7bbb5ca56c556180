"""Turning an /encode body (JSON or multipart) into the request's image and video bytes, in order.

Nothing here decodes pixels; it only enforces the request's shape (docs/api.md): known fields, 1 to
--max_images_per_request images and videos together, valid base64, URLs through vitserve.api.urls.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.datastructures import FormData, Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from vitserve.api.schemas import REQUEST_ID_MAX_CHARS, parse_json_request
from vitserve.api.urls import fetch_image_url
from vitserve.config import Config
from vitserve.errors import InvalidRequest, TooManyImages, VitserveError

_DATA_URL = re.compile(r"^data:[\w.+-]+/[\w.+-]+;base64,", re.IGNORECASE)
_FORM_FIELDS = ("images", "videos", "fps", "num_frames", "request_id", "return_embeddings")


@dataclass
class ImageSource:
    data: bytes | None = None  # the file's bytes (multipart part or decoded base64)
    url: str | None = None  # fetched later, once the whole request is known to be well formed


@dataclass
class VideoSource(ImageSource):
    """A video and its sampling settings (fps or num_frames; neither: the family's default)."""

    fps: float | None = None
    num_frames: int | None = None


@dataclass
class ParsedRequest:
    request_id: str
    sources: list[ImageSource]
    return_embeddings: bool
    videos: list[VideoSource] = field(default_factory=list)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def decode_b64(text: str, index: int, what: str = "images") -> bytes:
    """Standard base64, tolerating a data: URL prefix and line breaks."""
    text = _DATA_URL.sub("", text, count=1)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what}[{index}].b64 is not valid base64", image_index=index) from None


def check_count(n: int, config: Config, videos: int = 0) -> None:
    """1 to --max_images_per_request images and videos together (a video counts as one)."""
    if n + videos == 0:
        raise InvalidRequest("no images or videos in the request; send at least one")
    if n + videos > config.max_images_per_request:
        what = f"{n} images and {videos} videos" if videos else f"{n} images"
        raise TooManyImages(
            f"{what} in one request; at most {config.max_images_per_request} (--max_images_per_request)"
        )


def check_request_id(request_id: str | None) -> str:
    if request_id is None:
        return str(uuid.uuid4())
    if not 0 < len(request_id) <= REQUEST_ID_MAX_CHARS:
        raise InvalidRequest(f"request_id must have 1 to {REQUEST_ID_MAX_CHARS} characters")
    return request_id


def parse_json_body(body: bytes, config: Config) -> ParsedRequest:
    """CPU-bound (JSON + base64 of up to --max_request_bytes): the handler runs it on the preprocessing pool,
    or on the event loop for a body small enough that the hop would cost more (api/encode.py)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("malformed JSON body") from None
    for key in ("images", "videos"):
        items = payload.get(key) if isinstance(payload, dict) else None
        if isinstance(items, list) and len(items) > config.max_images_per_request:
            check_count(len(items), config)  # before validating thousands of entries
    req = parse_json_request(payload)
    check_count(len(req.images), config, len(req.videos))
    sources = [
        ImageSource(url=img.url) if img.url is not None else ImageSource(data=decode_b64(img.b64 or "", i))
        for i, img in enumerate(req.images)
    ]
    videos = [
        VideoSource(
            data=None if v.url is not None else decode_b64(v.b64 or "", i, "videos"),
            url=v.url,
            fps=v.fps,
            num_frames=v.num_frames,
        )
        for i, v in enumerate(req.videos)
    ]
    return ParsedRequest(check_request_id(req.request_id), sources, req.return_embeddings, videos)


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no", ""):
        return False
    raise InvalidRequest("return_embeddings must be 'true' or 'false'")


def parse_multipart_body(headers: Headers, body: bytes, config: Config) -> ParsedRequest:
    """CPU-bound (~8 ms per MB with python-multipart): run it on the preprocessing pool, not the event loop.

    Starlette's parser is async only; a private event loop in this worker thread drives it.
    """

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(headers, stream(), max_files=config.max_images_per_request + 1, max_fields=8)
    parser.spool_max_size = config.max_request_bytes  # the body is in memory already: no temp files on disk
    try:
        form = asyncio.run(parser.parse())
    except MultiPartException as exc:
        if "files" in exc.message.lower():
            check_count(config.max_images_per_request + 1, config)
        raise InvalidRequest(f"malformed multipart body: {exc.message}") from None
    try:
        return _form_request(form, config)
    finally:
        for _, value in form.multi_items():
            if isinstance(value, UploadFile):
                value.file.close()


def _form_request(form: FormData, config: Config) -> ParsedRequest:
    """`fps` and `num_frames` apply to every video of the request."""
    request_id, return_embeddings = None, False
    files: dict[str, list[bytes]] = {"images": [], "videos": []}
    sampling: dict[str, float | int] = {}
    for key, value in form.multi_items():
        if key not in _FORM_FIELDS:
            raise InvalidRequest(f"unknown form field {key!r}; allowed: {', '.join(_FORM_FIELDS)}")
        if key in files:
            if not isinstance(value, UploadFile):
                raise InvalidRequest(f"{key!r} must be file parts (filename=...)")
            value.file.seek(0)
            files[key].append(value.file.read())
        elif isinstance(value, UploadFile):
            raise InvalidRequest(f"form field {key!r} must be a plain value, not a file")
        elif key == "request_id":
            request_id = value
        elif key in ("fps", "num_frames"):
            sampling[key] = _parse_number(key, value)
        else:
            return_embeddings = _parse_bool(value)
    check_count(len(files["images"]), config, len(files["videos"]))
    fps, num_frames = sampling.get("fps"), sampling.get("num_frames")
    videos = [
        VideoSource(
            data=data,
            fps=None if fps is None else float(fps),
            num_frames=None if num_frames is None else int(num_frames),
        )
        for data in files["videos"]
    ]
    sources = [ImageSource(data=data) for data in files["images"]]
    return ParsedRequest(check_request_id(request_id), sources, return_embeddings, videos)


def _parse_number(key: str, value: str) -> float | int:
    """fps: a positive number; num_frames: a whole number >= 1 (the video processor checks the rest)."""
    try:
        number: float | int = int(value) if key == "num_frames" else float(value)
    except ValueError:
        kind = "a whole number" if key == "num_frames" else "a number"
        raise InvalidRequest(f"form field {key!r} must be {kind}, got {value[:40]!r}") from None
    return number


async def fetch_sources(
    sources: list[ImageSource] | list[VideoSource], config: Config, deadline: float
) -> list[bytes]:
    """Every image's (or video's) bytes, in order; URLs fetched concurrently. A video URL may bring up to
    --max_video_bytes, an image URL up to --max_request_bytes."""

    async def one(index: int, src: ImageSource) -> bytes:
        if src.data is not None:
            return src.data
        video = isinstance(src, VideoSource)
        try:
            return await fetch_image_url(
                src.url or "",
                allow=config.allow_image_urls,
                allowed_domains=config.allowed_url_domains,
                max_bytes=config.max_video_bytes if video else config.max_request_bytes,
                deadline=deadline,
                video=video,
            )
        except VitserveError as exc:
            raise (exc.with_video_index(index) if video else exc.with_index(index)) from None

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(sources))))
