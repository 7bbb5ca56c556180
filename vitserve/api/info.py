"""The resolved settings, once: the /v1/info body, and the start-up banner rendered from that same body.

Every setting that guards memory, load or exactness is a key of `info_body`, named as its flag is (or as
docs/design.md names the concept: budget_tokens, max_batch_images, family); `banner` prints each key of it in
one of the BANNER_LINES (a key no line names is printed on a line of its own), so the two cannot list
different settings. tests/e2e/test_service.py compares them, and fails on a flag that is in neither the body
nor its list of flags that guard nothing (where it listens, logs and traces, how nodes meet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import vitserve
from vitserve.config import Config, redacted_url
from vitserve.contract import Engine
from vitserve.errors import ConfigError
from vitserve.processors.base import VisionProcessor
from vitserve.transport_specs import SPECS, transports_info

# The banner's lines: a label and the info keys it shows, in order.
BANNER_LINES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "family", "embed_dim", "dtype", "device")),
    (
        "budget",
        (
            "budget_tokens",
            "budget_source",
            "visual_mem_gb",
            "visual_mem_sizing",
            "max_batch_images",
            "max_video_tokens",
        ),
    ),
    ("processor clamp", ("processor_clamp",)),
    ("layout", ("tp", "dp", "nnodes")),
    (
        "reserved memory per rank",
        ("reserved_memory_bytes", "reserved_source", "visual_reserved_mem_gb", "runtime_dir"),
    ),
    ("limits", ("limits",)),
    ("video", ("video_decoders", "video_processor")),
    ("liveness", ("heartbeat_s", "dist_timeout_s")),
    ("LLM", ("llm_endpoint", "llm_url", "llm_timeout_s", "llm_transport")),
    *(spec.banner for spec in SPECS.values() if spec.banner is not None),  # each transport's own line
    ("security", ("security",)),
    ("cache", ("cache",)),
    ("output", ("exact", "jpeg_draft", "image_resize")),
)


def resolved_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _redacted(url: str | None) -> str | None:
    return redacted_url(url) if url else None


def info_body(config: Config, engine: Engine, processor: VisionProcessor) -> dict[str, Any]:
    """GET /v1/info (docs/api.md): the engine's facts and every resolved guard. No secret is in it."""
    info = engine.info()
    return {
        "model": info.model,
        "family": info.family,
        "tp": info.tp,
        "dp": info.dp,
        "nnodes": config.nnodes,
        "embed_dim": info.embed_dim,
        "dtype": info.dtype,
        "device": resolved_device(config.device),
        "budget_tokens": config.visual_batch_max_tokens,
        "budget_source": config.budget_source,  # flag, or visual_mem_gb: chosen by the ranks to fit it
        "visual_mem_gb": config.visual_mem_gb,  # None: no memory target
        "visual_mem_sizing": info.sizing,  # with it alone: why the budget (docs/api.md); None otherwise
        "max_batch_images": config.visual_infer_batch_size,
        "max_video_tokens": config.max_video_tokens,  # what one video may cost in all; 0: no cap
        "processor_clamp": processor.clamp_info(),
        "reserved_memory_bytes": {str(k): v for k, v in info.reserved_memory_bytes.items()},
        "reserved_source": info.reserved_source,
        "visual_reserved_mem_gb": config.visual_reserved_mem_gb,  # None: measured at start-up
        "cuda_graphs": config.cuda_graphs,  # graphs per token bucket; their pool is in the reservation
        "runtime_dir": config.runtime_dir,  # where reserved_mem_<device>_<rank>.json is, for the LLM server
        "limits": {
            "max_queue_tokens": config.queue_token_limit,
            "max_images_per_request": config.max_images_per_request,
            "max_request_bytes": config.max_request_bytes,
            "max_image_pixels": config.max_image_pixels,
            "request_timeout_s": config.request_timeout_s,
            "max_video_bytes": config.max_video_bytes,  # a video's header checks, before any decoding
            "max_video_duration_s": config.max_video_duration_s,
            "max_video_frames": config.max_video_frames,
        },
        "video_decoders": config.video_decoders,  # videos decoded at a time; 0: the server takes no videos
        "video_processor": video_defaults(config, processor),
        "heartbeat_s": config.heartbeat_s,  # a rank silent for 2x this is failed; /ready says so
        "dist_timeout_s": config.dist_timeout_s,
        "llm_endpoint": config.llm_endpoint,
        "llm_url": _redacted(config.llm_url),
        "llm_timeout_s": config.llm_timeout_s,
        "llm_transport": config.llm_transport,  # how --llm_url gets embeddings (vitserve/transport_specs.py)
        **transports_info(config),  # every transport's settings, whichever serves: the keys never change
        "security": {
            "api_key": config.api_key is not None,
            "llm_api_key": config.llm_api_key is not None,
            "wire_key": config.wire_key_file is not None,  # the vLLM connector's shared secret is set
            "wire_security": config.wire_security or "curve",  # how that secret keys the wire (curve | tag)
            "allow_image_urls": config.allow_image_urls,
            "allowed_url_domains": list(config.allowed_url_domains),
        },
        "cache": {
            "cache_gb": config.cache_gb,
            "cache_url": _redacted(config.cache_url),
            "cache_ttl_s": config.cache_ttl_s,
        },
        "jpeg_draft": config.jpeg_draft,
        "exact": not config.jpeg_draft,  # what may make embeddings differ from transformers'
        "image_resize": processor.clamp_info()["image_resize"],  # whose pixels: resolved from --image_resize
        "version": vitserve.__version__,
    }


def video_defaults(config: Config, processor: VisionProcessor) -> dict[str, Any] | None:
    """The checkpoint's video processor as vitserve resolved it (docs/video.md): how a video is sampled when a
    request sets neither fps nor num_frames, and the pixel bounds of its frames. None when the server takes no
    videos; {"error": ...} when the checkpoint's video processor config cannot be served (each video is then
    refused with the same message)."""
    if not config.video_decoders:
        return None
    from vitserve.video.settings import video_settings

    try:
        s = video_settings(processor.family, processor.checkpoint, processor)
    except ConfigError as exc:
        return {"error": str(exc)}
    return {
        "default_fps": s.sampling.default_fps,
        "sampler": s.sampling.sampler,
        "min_frames": s.sampling.min_frames,
        "max_frames": s.sampling.max_frames,
        "temporal_patch_size": s.temporal_patch_size,
        "min_pixels": s.min_pixels,
        "max_pixels": s.max_pixels,  # as shipped; each video's clamp is in its plan (resized_size, clamped)
        "pixels_bound": s.resize,
        "cap_pixels_per_frame": s.cap_pixels_per_frame,
        "settings_from": s.source,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _value(key: str, value: Any) -> str:
    if key == "budget_tokens":
        return f"{value} tokens per batch and per image" if value else "OFF (no clamp)"
    if key == "max_video_tokens" and not value:
        return "0 (no cap)"
    if key == "max_queue_tokens" and value is None:
        return "unlimited"
    if key == "reserved_memory_bytes":
        return ", ".join(f"rank {r}: {_mib(b)}" for r, b in sorted(value.items(), key=lambda x: int(x[0])))
    if key == "exact":
        return (
            "exact (matches transformers)" if value else "NOT exact: --jpeg_draft is on (docs/jpeg_draft.md)"
        )
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == []:
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _pairs(info: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    out = []
    for key in keys:
        value = info[key]
        if isinstance(value, Mapping) and key not in ("processor_clamp", "reserved_memory_bytes"):
            out.append(_pairs(value, tuple(value)))
        elif key == "processor_clamp":
            out.append(str(dict(value)))
        elif key in ("exact", "reserved_memory_bytes"):  # the value says what it is: "rank 0: 1.0 MiB"
            out.append(_value(key, value))
        else:
            out.append(f"{key}={_value(key, value)}")
    return ", ".join(out)


def banner(info: Mapping[str, Any], url: str) -> str:
    """The start-up banner: one line per BANNER_LINES entry, every key of the info body shown once."""
    shown = {key for _, keys in BANNER_LINES for key in keys} | {"version"}
    lines = [f"vitserve {info['version']} serving on {url}"]
    lines += [f"  {label}: {_pairs(info, keys)}" for label, keys in BANNER_LINES]
    lines += [f"  {key}: {_pairs(info, (key,))}" for key in info if key not in shown]
    return "\n".join(lines)
