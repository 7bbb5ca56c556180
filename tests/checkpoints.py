"""Tiny real checkpoints for every family, written by transformers' own save_pretrained, and the HF reference.

make_checkpoint(family, path) builds the FULL model (vision tower + merger/projector + a one-layer language
model) from tiny seeded configs, saves it as safetensors (optionally sharded, optionally with the old
`visual.*` key layout) and writes a preprocessor_config.json consistent with the vision config.
hf_reference(path, family) loads that full model with from_pretrained and returns the vision output the
LLM would receive, computed exactly the way transformers computes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl")

# Vision widths are 32 with 4 heads (TP=4 divides heads and every MLP width); the language width is 48 so a
# mix-up between the vision width and the output width cannot go unnoticed.
_TEXT_HIDDEN = 48
_QWEN_TEXT = {
    "vocab_size": 64,
    "hidden_size": _TEXT_HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": None,  # the real ids lie outside the tiny vocabulary
    "eos_token_id": None,
}
# Qwen's real special-token ids (151655, ...) lie outside the tiny vocabulary; these fit, so a prompt built
# from config.image_token_id runs (docs/integration.md).
_QWEN_TOKEN_IDS = {
    "image_token_id": 5,
    "video_token_id": 6,
    "vision_start_token_id": 7,
    "vision_end_token_id": 8,
}
# head_dim 12 -> mrope sections sum to 6.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}

VISION_CONFIGS: dict[str, dict] = {
    # Qwen2-VL: `embed_dim` is the tower width, `hidden_size` the merger output (= LLM width).
    "qwen2_vl": {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": _TEXT_HIDDEN,
        "mlp_ratio": 4,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    # window_size 56 px = 2x2 merged units per window, so a 4x4-unit image has 4 windows; blocks 1 and 3
    # are full attention, 0 and 2 windowed.
    "qwen2_5_vl": {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": _TEXT_HIDDEN,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1, 3],
    },
    # 16 learned positions (a 4x4 grid, bilinearly resampled per image); deepstack after blocks 0 and 2.
    "qwen3_vl": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": _TEXT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 2],
    },
    "qwen3_5": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": _TEXT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
    },
    # 56 px tiles of 14 px patches: 4x4 patches + CLS; pixel shuffle 0.5 -> 4 tokens per tile.
    "internvl": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "image_size": [56, 56],
        "patch_size": [14, 14],
        "layer_scale_init_value": 0.1,
    },
}

# Small pixel limits so tests can use small images; the HF processors clamp to them.
_QWEN_PIX = {
    "qwen2_vl": (28, 4, 64, "OPENAI_CLIP"),
    "qwen2_5_vl": (28, 4, 64, "OPENAI_CLIP"),
    "qwen3_vl": (32, 4, 64, "HALF"),
    "qwen3_5": (32, 4, 64, "HALF"),
}
_MEANS = {
    "OPENAI_CLIP": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
    "HALF": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    "IMAGENET": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
}


def _config(family: str):
    import transformers as tf

    vision = VISION_CONFIGS[family]
    if family == "qwen2_vl":
        return tf.Qwen2VLConfig(
            text_config={**_QWEN_TEXT, "rope_parameters": _MROPE}, vision_config=vision, **_QWEN_TOKEN_IDS
        )
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config={**_QWEN_TEXT, "rope_parameters": _MROPE}, vision_config=vision
        )
    if family == "qwen3_vl":
        text = {**_QWEN_TEXT, "head_dim": 12, "rope_parameters": {**_MROPE, "mrope_interleaved": True}}
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision)
    if family == "qwen3_5":
        text = {
            **_QWEN_TEXT,
            "num_hidden_layers": 2,
            "head_dim": 12,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
        }
        return tf.Qwen3_5Config(text_config=text, vision_config=vision)
    if family == "internvl":
        text = {"model_type": "qwen2", **_QWEN_TEXT}
        return tf.InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _model_class(family: str):
    import transformers as tf

    return {
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "internvl": tf.InternVLForConditionalGeneration,
    }[family]


def _preprocessor_config(family: str) -> dict:
    if family == "internvl":
        side = VISION_CONFIGS["internvl"]["image_size"][0]
        mean, std = _MEANS["IMAGENET"]
        return {
            "image_processor_type": "GotOcr2ImageProcessor",
            "processor_class": "InternVLProcessor",
            "size": {"height": side, "width": side},
            "crop_to_patches": True,
            "min_patches": 1,
            "max_patches": 4,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,
            "image_mean": mean,
            "image_std": std,
        }
    factor, min_units, max_units, norm = _QWEN_PIX[family]
    vision = VISION_CONFIGS[family]
    mean, std = _MEANS[norm]
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"shortest_edge": factor * factor * min_units, "longest_edge": factor * factor * max_units},
        "min_pixels": factor * factor * min_units,
        "max_pixels": factor * factor * max_units,
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "image_mean": mean,
        "image_std": std,
    }


def _new_key(family: str, key: str) -> str:
    """Any saved key -> the transformers 5 module layout (model.visual.*, model.language_model.*, lm_head.*).

    save_pretrained in 5.23 writes Qwen2-VL/Qwen2.5-VL and InternVL back in their original hub layout and
    Qwen3-VL/Qwen3.5 in the module layout, so both directions are normalised through this form.
    """
    if family == "internvl":
        for old, new in _INTERNVL_OLD_TO_NEW:
            if key.startswith(old):
                return new + key[len(old) :]
        return key
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.visual.", "model.language_model.")):
        return "model.language_model." + key[len("model.") :]
    return key


_INTERNVL_OLD_TO_NEW = (
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)


def _old_key(family: str, key: str) -> str:
    """transformers 5 module layout -> the pre-v5 hub layout (visual.* + model.*; InternVL vision_tower.*)."""
    if family == "internvl":
        for old, new in _INTERNVL_OLD_TO_NEW:
            if key.startswith(new):
                return old + key[len(new) :]
        return key
    if key.startswith("model.visual."):
        return key[len("model.") :]
    # Qwen2-VL/2.5-VL hub checkpoints keep the language model under model.*; Qwen3-VL/3.5 were published with
    # model.language_model.* (transformers maps only their vision keys), so only the vision prefix moves.
    if key.startswith("model.language_model.") and family in ("qwen2_vl", "qwen2_5_vl"):
        return "model." + key[len("model.language_model.") :]
    return key


def _rewrite_layout(family: str, path: Path, layout: str) -> None:
    def rename(key: str) -> str:
        key = _new_key(family, key)
        return _old_key(family, key) if layout == "visual" else key

    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(file)
        save_file({rename(k): v for k, v in tensors.items()}, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def make_checkpoint(
    family: str, path, *, layout: str = "model.visual", sharded: bool = False, seed: int = 0
) -> Path:
    """Write a tiny real full-model checkpoint of `family` into `path` (created) and return it.

    layout="model.visual": the transformers 5 module layout (model.visual.*, model.language_model.*;
    InternVL model.vision_tower.*, model.multi_modal_projector.*). layout="visual": the original hub layout
    (visual.* + model.*; InternVL vision_tower.*, multi_modal_projector.*, language_model.model.*).
    save_pretrained writes some families one way and some the other; the keys are rewritten to the one asked.
    sharded=True splits into several shards + model.safetensors.index.json, the vision weights spread over
    more than one shard and at least one shard holding only language weights.
    """
    if layout not in ("model.visual", "visual"):
        raise ValueError(f"layout must be 'model.visual' or 'visual', got {layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = _config(family)
    model = _model_class(family)(config).eval()
    _perturb_zero_inits(model, seed)
    # The vision tower is a few hundred KB; 40 KB shards spread it over several files and leave the
    # language weights (saved after it) in shards of their own.
    shard = 40_000 if sharded else "50GB"
    model.save_pretrained(path, max_shard_size=shard, safe_serialization=True)
    _rewrite_layout(family, path, layout)
    (path / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(family), indent=2))
    write_video_config(family, path)
    return path


# transformers' video processor class of each family (AutoVideoProcessor needs it named: without it, it builds
# Qwen2-VL's for every family) and the tiny pixel limits: Qwen2 bounds each frame, Qwen3 all frames together.
_VIDEO_CLASSES = {
    "qwen2": "Qwen2VLVideoProcessor",
    "qwen3": "Qwen3VLVideoProcessor",
    "internvl": "InternVLVideoProcessor",
}


def write_video_config(family: str, path, **overrides) -> Path:
    """Write the checkpoint's video_preprocessor_config.json (the image settings, its class, small limits:
    4 to 64 merge units per frame for Qwen2, 4 to 256 in all for Qwen3) with ``overrides`` on top."""
    config = {
        k: v
        for k, v in _preprocessor_config(family).items()
        if k not in ("image_processor_type", "processor_class")
    }
    kind = "internvl" if family == "internvl" else family[:5]
    config = {**config, "video_processor_type": _VIDEO_CLASSES[kind], "do_sample_frames": True}
    for key in ("crop_to_patches", "min_patches", "max_patches", "min_pixels", "max_pixels"):
        config.pop(key, None)
    if kind == "qwen3":
        factor = _QWEN_PIX[family][0]
        config["size"] = {"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * 256}
    path = Path(path) / "video_preprocessor_config.json"
    path.write_text(json.dumps({**config, **overrides}, indent=2))
    return path


def _perturb_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; randomise every tensor so a weight loaded into the wrong
    slot (or not loaded at all) changes the output."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if p.dim() == 1:
                p.copy_((1.0 if torch.all(p == 1) else 0.0) + 0.1 * noise)
            elif torch.all(p == 0):
                p.copy_(0.02 * noise)


def vision_prefixes(family: str, layout: str = "model.visual") -> tuple[str, ...]:
    """Key prefixes of the weights vitserve must read (vision tower + merger/projector)."""
    if family == "internvl":
        new = ("model.vision_tower.", "model.multi_modal_projector.")
        return new if layout == "model.visual" else tuple(p[len("model.") :] for p in new)
    return ("model.visual.",) if layout == "model.visual" else ("visual.",)


def hf_reference(
    path, family: str, dtype: torch.dtype = torch.float32
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
    """Load the full model with from_pretrained and return f(pixel_values, grid_thw) -> (embeds, deepstack).

    Qwen families: `model.model.visual(pixel_values, grid_thw=grid_thw)` -> .pooler_output (merged tokens)
    and, for Qwen3-VL, .deepstack_features. InternVL: `model.model.get_image_features(pixel_values)` ->
    .pooler_output of shape (tiles, tokens_per_tile, dim), flattened to rows (grid_thw unused).
    dtype is passed to from_pretrained; pixels are cast to it as transformers' get_image_features does.
    """
    model = _model_class(family).from_pretrained(str(path), dtype=dtype).eval()

    @torch.inference_mode()
    def run(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None):
        pixel_values = pixel_values.to(dtype)
        if family == "internvl":
            out = model.model.get_image_features(pixel_values=pixel_values).pooler_output
            return out.reshape(-1, out.shape[-1]), []
        out = model.model.visual(pixel_values, grid_thw=grid_thw)
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])

    run.model = model  # type: ignore[attr-defined]
    return run


# ------------------------------------------------------------------------------------------------------
# Checkpoints a real vLLM can serve (tests/vllm/, bench/gateway.py)
# ------------------------------------------------------------------------------------------------------
# vLLM needs a tokenizer, a chat template and a processor besides the weights, and its CPU attention takes
# only some head sizes (32 works, 12 does not): hidden 64, 2 heads of 32, M-RoPE sections [4, 6, 6].
SERVABLE_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SERVABLE_TEXT_HIDDEN = 64
_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen's template, cut to what a test prompt uses: text, image and video parts (vLLM names an embedding part
# "image" or "image_embeds" when it renders the template; both become the image placeholder).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] in ['image', 'image_url', 'image_embeds'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] in ['video', 'video_url', 'video_embeds'] %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer(path: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer (256 byte tokens, no merges: every string encodes) plus Qwen's special
    tokens, saved with the chat template; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # a stable order
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)
    return {s: tok.token_to_id(s) for s in _SPECIALS}


def make_servable_checkpoint(
    family: str,
    path,
    *,
    vision: dict | None = None,
    seed: int = 0,
    max_units: int = 256,
    text: dict | None = None,
) -> Path:
    """A tiny full checkpoint of `family` (qwen2_5_vl or qwen3_vl) that vLLM serves and vitserve encodes.

    The vision tower is VISION_CONFIGS[family] (or `vision`, e.g. a realistic width for bench/gateway.py) with
    its output width set to the language model's (64, or the hidden_size in `text`, which overrides fields of
    the language model's config, e.g. a real width for bench/gateway.py --widths). lm_head is scaled up 40x so a
    random model's logprobs are informative rather than flat. The image processor's limits are 4 to `max_units` merge units per
    image; its video processor config names its class (transformers otherwise builds Qwen2-VL's for Qwen3-VL).
    """
    import transformers as tf

    if family not in SERVABLE_FAMILIES:
        raise ValueError(f"vLLM-servable checkpoints exist for {SERVABLE_FAMILIES}, not {family!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _byte_level_tokenizer(path)
    vocab = 256 + len(_SPECIALS) + 9  # every id decodes; a multiple of 8
    overrides = dict(text or {})
    mrope = overrides.pop("mrope_section", [4, 6, 6])  # sums to head_dim / 2
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}
    text = {
        "vocab_size": vocab,
        "hidden_size": SERVABLE_TEXT_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        **overrides,
    }
    token_ids = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    vision = {**(vision or VISION_CONFIGS[family]), "out_hidden_size": text["hidden_size"]}
    torch.manual_seed(seed)
    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": rope}, vision_config=vision, **token_ids
        )
    else:
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **token_ids)
    config.eos_token_id = ids["<|im_end|>"]
    model = _model_class(family)(config).eval()
    _perturb_zero_inits(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path, safe_serialization=True)
    image = _preprocessor_config(family)
    factor = _QWEN_PIX[family][0]
    image["size"] = {"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * max_units}
    image["min_pixels"], image["max_pixels"] = image["size"]["shortest_edge"], image["size"]["longest_edge"]
    processor = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor"
    (path / "preprocessor_config.json").write_text(
        json.dumps({**image, "processor_class": processor}, indent=2)
    )
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video["video_processor_type"] = (
        "Qwen2VLVideoProcessor" if family == "qwen2_5_vl" else "Qwen3VLVideoProcessor"
    )
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    return path
