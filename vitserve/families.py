"""The model-family registry: every fact about a family, defined once, with no torch or transformers import.

A family is a vision-tower design that vitserve can load and preprocess for. Its key (``Family.name``) is the
one name used everywhere (--model_family, logs, /v1/info); ``model_types`` are the config.json values that
BOTH the processors (vitserve.processors) and the loader (vitserve.model.adapters) accept, and both assert at
import that they cover exactly these.

The numbers are the public defaults of the published checkpoints' preprocessor_config.json, used when a
checkpoint ships no processor config (the HF class defaults differ: Qwen2VLImageProcessorPil's own
max_pixels is 28*28*1280, while every released Qwen2/2.5-VL checkpoint ships 12845056 = 28*28*16384;
transformers does not carry Qwen3-VL's image defaults at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from vitserve.errors import ConfigError

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Family:
    name: str  # "qwen2_5_vl": the one key used everywhere
    display: str  # "Qwen2.5-VL": for messages and the TP pass
    layout: Literal[
        "patches", "tiles"
    ]  # packed patch rows with a spatial merge | fixed tiles + pixel shuffle
    model_types: tuple[str, ...]  # config.json model_type values the processor AND the loader accept
    patch_size: int  # defaults when a checkpoint ships no processor config
    merge_size: int = 0  # patches: spatial merge (2 = 2x2 patches per token)
    temporal_patch_size: int = 0  # patches
    min_pixels: int = 0  # patches: HF size["shortest_edge"]
    max_pixels: int = 0  # patches: HF size["longest_edge"]
    tile_size: int = 0  # tiles
    min_tiles: int = 0  # tiles: HF min_patches
    max_tiles: int = 0  # tiles: HF max_patches (the thumbnail comes on top)
    downsample_ratio: float = 0.0  # tiles: pixel shuffle, 0.5 = 2x2 patches per token
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    deepstack: bool = False  # the tower also returns per-layer deepstack features
    # Where the vision config keeps the sizes vitserve/model/tp.py splits across --tp ranks (vitserve/preflight.py
    # checks them): attention heads, the width, and whether the MLP width is width * mlp_ratio (Qwen2-VL).
    heads_key: str = "num_heads"
    width_key: str = "hidden_size"
    mlp_from_ratio: bool = False
    # Video (vitserve/video/, docs/processing.md "Video"): the rules of the family's transformers video
    # processor, and its class defaults where a checkpoint ships no video processor config.
    video_sampler: Literal["qwen2", "qwen3", "internvl"] = "qwen2"  # how frame indices are chosen
    video_resize: Literal["per_frame", "total", "tile"] = "per_frame"  # what size["longest_edge"] bounds
    video_time: Literal["none", "second_per_grid", "timestamps"] = "none"  # the time the LLM is given
    video_min_pixels: int = 0  # patches: size["shortest_edge"] (per frame, or over all frames for "total")
    video_max_pixels: int = 0  # patches: size["longest_edge"] (per frame, or over all frames for "total")
    video_min_frames: int = 4  # fps sampling never takes fewer frames (qwen samplers)
    video_max_frames: int = 768  # ... nor more
    video_fps: float | None = None  # the class's own fps default (None: vitserve's VIDEO_DEFAULT_FPS)


def _qwen2(name: str, display: str) -> Family:
    return Family(
        name,
        display,
        "patches",
        (name,),
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
        video_time="second_per_grid" if name == "qwen2_5_vl" else "none",
        video_min_pixels=128 * 28 * 28,
        video_max_pixels=768 * 28 * 28,
    )


def _qwen3(name: str, display: str, *, deepstack: bool) -> Family:
    # MoE variants share their dense family's tower and processor.
    return Family(
        name,
        display,
        "patches",
        (name, f"{name}_moe"),
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=64 * 32 * 32,
        max_pixels=16384 * 32 * 32,
        image_mean=_HALF,
        image_std=_HALF,
        deepstack=deepstack,
        video_sampler="qwen3",
        video_resize="total",
        video_time="timestamps",
        video_min_pixels=128 * 32 * 32,
        video_max_pixels=768 * 32 * 32,
        video_fps=2.0,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        replace(_qwen2("qwen2_vl", "Qwen2-VL"), width_key="embed_dim", mlp_from_ratio=True),
        _qwen2("qwen2_5_vl", "Qwen2.5-VL"),
        _qwen3("qwen3_vl", "Qwen3-VL", deepstack=True),
        _qwen3("qwen3_5", "Qwen3.5", deepstack=False),
        # HF's "internvl" layout: GotOcr2 processor, 448 tiles of 14-px patches, pixel shuffle 0.5 -> 256 tokens.
        Family(
            "internvl",
            "InternVL",
            "tiles",
            ("internvl",),
            heads_key="num_attention_heads",
            patch_size=14,
            tile_size=448,
            min_tiles=1,
            max_tiles=12,
            downsample_ratio=0.5,
            image_mean=_IMAGENET_MEAN,
            image_std=_IMAGENET_STD,
            video_sampler="internvl",
            video_resize="tile",  # every frame is resized to one tile
        ),
    )
}
FAMILY_CHOICES = ("auto", *FAMILIES)  # --model_family
# fps when neither the request (fps, num_frames) nor the checkpoint's video processor config sets fps: the Qwen
# reference default (Qwen3-VL's class default); the Qwen2 and InternVL classes would decode every frame.
VIDEO_DEFAULT_FPS = 2.0
MAX_ASPECT_RATIO = 200  # HF smart_resize raises above this long/short side ratio
# Budget 0 (disabled): the start-up stress covers one image of HF's default Qwen2-VL max_pixels (16384 tokens).
_QWEN2 = FAMILIES["qwen2_vl"]
DISABLED_BUDGET_TOKENS = _QWEN2.max_pixels // (_QWEN2.patch_size * _QWEN2.merge_size) ** 2
# model_types that look like a family but that the loader cannot read: refused at start-up, naming --model.
UNLOADABLE_MODEL_TYPES = {
    "internvl_chat": "the remote-code InternVL layout (vision_model.* / mlp1.* weights), which vitserve cannot "
    "load; use a transformers-format InternVL checkpoint (model_type internvl)",
}
_OF_MODEL_TYPE = {mt: f for f in FAMILIES.values() for mt in f.model_types}
MODEL_TYPES = tuple(_OF_MODEL_TYPE)  # every accepted config.json model_type


def family_of_model_type(model_type: str, family: str = "auto") -> Family:
    """The family for a checkpoint's config.json ``model_type`` and a --model_family value (which wins, so a
    fine-tune with its own model_type can still name its tower). One check for processors and loader."""
    if model_type in UNLOADABLE_MODEL_TYPES:
        raise ConfigError(f"--model: model_type {model_type!r} is {UNLOADABLE_MODEL_TYPES[model_type]}")
    if family != "auto":
        if family not in FAMILIES:
            raise ConfigError(f"--model_family {family!r} is not one of {', '.join(FAMILY_CHOICES)}")
        return FAMILIES[family]
    found = _OF_MODEL_TYPE.get(model_type)
    if found is None:
        raise ConfigError(
            f"unknown model_type {model_type!r} in config.json; set --model_family to one of "
            f"{', '.join(FAMILIES)} if the checkpoint uses one of those vision towers"
        )
    return found


def tokens_per_tile(tile: int, patch: int, downsample_ratio: float) -> int:
    """Tokens one tile yields: HF InternVL's pixel_shuffle turns (side, side) patches into
    (int(side*r), int(side*r)) tokens, and fails when side*r is not a whole number (its view() then
    cannot reshape), so such a geometry is refused here instead of on the first batch."""
    if tile % patch:
        raise ConfigError(
            f"tile {tile} is not a multiple of the vision patch {patch}; fix the checkpoint (--model)"
        )
    side = tile // patch
    shuffled = side * downsample_ratio
    if shuffled != int(shuffled) or shuffled < 1:
        raise ConfigError(
            f"tile {tile} / patch {patch} = {side} patches per side, which downsample_ratio {downsample_ratio} "
            "does not divide into whole tokens; fix the checkpoint (--model)"
        )
    return int(shuffled) ** 2


GEOMETRY_KEYS = ("patch_size", "merge_size", "tokens_per_tile")  # where processor and tower must agree


def check_geometry(processor_clamp: Mapping[str, Any], tower: Mapping[str, int]) -> None:
    """Refuse to serve when the processor's grid and the tower's disagree on any of GEOMETRY_KEYS present in
    both (a processor's clamp_info, the tower's numbers): otherwise the first batch fails inside the ranks
    (the encoder gets rows for another grid) and takes the group down."""
    display = FAMILIES[processor_clamp["family"]].display
    for key in GEOMETRY_KEYS:
        ours, theirs = processor_clamp.get(key), tower.get(key)
        if ours is not None and theirs is not None and int(ours) != int(theirs):
            raise ConfigError(
                f"--model: the {display} image processor has {key} {ours} but the vision tower has {theirs}; "
                "fix preprocessor_config.json or config.json in the checkpoint"
            )
