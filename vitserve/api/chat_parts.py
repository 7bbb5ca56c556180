"""The media parts of an OpenAI chat request (docs/vllm.md): every `image_url` and `video_url` part, in message
order, with the JSON path that names it in an error and the dict that is rewritten in place.

A part's URL is a `data:` URL with base64 or an http(s) URL (fetched later under the URL policy, docs/api.md).
A video's sampling comes from the request's `mm_processor_kwargs` (`fps` or `num_frames`), the field where
vLLM takes the video processor's settings; it applies to every video of the request. vitserve consumes those
two keys (the LLM server gets embeddings, sampled already): they are removed before the request goes upstream,
and so is `mm_processor_kwargs` when nothing else is left in it (vLLM refuses per-request
`mm_processor_kwargs` unless started with `--trust-request-mm-kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vitserve.api.inputs import ImageSource, VideoSource, decode_b64
from vitserve.errors import InvalidRequest

# Parts the client may not send: an embedding from outside would reach the LLM server unchecked, and some
# malformed ones kill its engine (docs/vllm.md). vitserve makes them from images and videos. Nor a part's
# `uuid`: an EC-consumer vLLM loads the file a uuid names (any path) and dies on one that is not there.
_EMBEDS_PARTS = frozenset({"image_embeds", "video_embeds"})
_MEDIA = {"image_url": "image", "video_url": "video"}
SAMPLING_KWARGS = ("fps", "num_frames")  # the mm_processor_kwargs vitserve reads for videos


@dataclass
class MediaPart:
    """One `image_url` or `video_url` content part: where it is, and the dict that will be rewritten."""

    param: str  # its JSON path, e.g. messages[1].content[0], for OpenAI's `param`
    part: dict[str, Any]
    source: ImageSource  # a VideoSource for a video part


@dataclass
class ChatParts:
    images: list[MediaPart] = field(default_factory=list)
    videos: list[MediaPart] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.images or self.videos)


def media_parts(payload: Any) -> ChatParts:
    """Every image_url and video_url part, each kind in message order; InvalidRequest (with its path) for a
    malformed one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        raise InvalidRequest(
            "the body must be a JSON object with a 'messages' list (OpenAI chat completions)"
        )
    found = ChatParts()
    sampling: dict[str, float | int] | None = None
    for i, message in enumerate(payload["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue  # a string or no content: nothing to encode
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, dict) and "uuid" in part:
                raise InvalidRequest(
                    f"{param}: a 'uuid' is not accepted; vitserve names the embeddings it sends the LLM "
                    "server itself (docs/vllm.md)"
                )
            if kind in _EMBEDS_PARTS:
                raise InvalidRequest(
                    f"{param}: {kind} parts are not accepted; send the image or video itself "
                    "(image_url, video_url) and vitserve encodes it"
                )
            if kind == "image_url":
                found.images.append(MediaPart(param, part, ImageSource(**_located(part, kind, param))))
            elif kind == "video_url":
                sampling = _sampling(payload) if sampling is None else sampling
                source = VideoSource(**_located(part, kind, param), **sampling)  # type: ignore[arg-type]
                found.videos.append(MediaPart(param, part, source))
    if found.videos:
        _consume_sampling(payload)
    return found


def _located(part: dict[str, Any], kind: str, param: str) -> dict[str, Any]:
    spec = part.get(kind)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{param}.{kind} must be an object with a 'url' (a data: URL or http(s) URL)")
    if url.startswith("data:"):
        return {"data": _data_url_bytes(url, f"{param}.{kind}.url", _MEDIA[kind])}
    return {"url": url}


def _data_url_bytes(url: str, where: str, media: str) -> bytes:
    head, sep, _ = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data: URL must be base64 (data:{media}/...;base64,...)")
    try:
        return decode_b64(url, 0)
    except InvalidRequest:
        raise InvalidRequest(f"{where} is not valid base64") from None


def _consume_sampling(payload: dict[str, Any]) -> None:
    kwargs = payload.get("mm_processor_kwargs")
    if isinstance(kwargs, dict):
        for key in SAMPLING_KWARGS:
            kwargs.pop(key, None)
        if not kwargs:
            del payload["mm_processor_kwargs"]


def _sampling(payload: dict[str, Any]) -> dict[str, float | int]:
    """`fps` (a number > 0) or `num_frames` (a whole number >= 1) from mm_processor_kwargs, for every video;
    the video processor refuses both together (400 invalid_video_sampling), as transformers does."""
    kwargs = payload.get("mm_processor_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("mm_processor_kwargs must be an object")
    out: dict[str, float | int] = {}
    fps = kwargs.get("fps")
    if fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
            raise InvalidRequest(f"mm_processor_kwargs.fps must be a number > 0, got {fps!r:.40}")
        out["fps"] = float(fps)
    num_frames = kwargs.get("num_frames")
    if num_frames is not None:
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            raise InvalidRequest(
                f"mm_processor_kwargs.num_frames must be a whole number >= 1, got {num_frames!r:.40}"
            )
        out["num_frames"] = num_frames
    return out
