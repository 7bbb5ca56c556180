"""The checkpoint behind --model, read once: `Checkpoint.open(path_or_name)`, or `Checkpoint.demo()`.

A `Checkpoint` holds every JSON file vitserve reads from a checkpoint directory (config.json, the image
processor's config, the video processor's config), the family they resolve to (vitserve/families.py), the
vision tower's patch geometry, the hidden size of the language model that will take the embeddings, and the
definition of the weights' content digest. It is built once at the entry point and passed down: to the
start-up checks (preflight.py), the image processor (processors/), the forkserver's preload (processes/zygote.py)
and, pickled with the rank's arguments, to the loader (model/loader.py), which feeds each vision tensor it
reads to `WeightsDigest`. No other module opens these files.

`Checkpoint.demo()` is the one place that knows the demo model: a Qwen2.5-VL-shaped tower whose weights are
drawn from a fixed seed instead of read from files. Everything downstream sees a checkpoint like any other,
with `seed` set and no `path`.

Layer 0: json, hashlib and the family registry only; no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, MODEL_TYPES, Family, family_of_model_type

DEMO = "demo"  # the --model value of the demo (and Config's default)
_DEMO_SEED = 0
# The demo's vision config: 8 blocks of width 512, shaped like the public Qwen2.5-VL processor defaults
# (patch 14, merge 2, temporal 2) so that the family's default processor fits it; small enough for a CPU.
_DEMO_VISION_CONFIG: dict[str, Any] = {
    "depth": 8,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_heads": 8,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,  # Qwen2.5-VL's: 4x4 merged units per window
    "fullatt_block_indexes": [3, 7],
    "out_hidden_size": 1024,
}
_DEMO_MODEL_TYPE = "qwen2_5_vl"

CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # newer checkpoints: the image processor under "image_processor"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def first_size(value: Any) -> int:
    """HF configs store a size as an int or as an [h, w] pair; the towers here are square."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def model_name_of(path: Path) -> str:
    """The checkpoint directory's name; for a Hugging Face cache snapshot (models--org--name/snapshots/<sha>)
    the repo id "org/name", since the directory name there is a commit hash."""
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    return parts[-1]


@dataclass(frozen=True)
class Geometry:
    """The vision tower's grid as config.json states it, the family's defaults where it is silent."""

    patch_size: int
    merge_size: int  # patches layout: spatial merge (2 = 2x2 patches per token); tiles: 0
    temporal_patch_size: int  # patches layout; tiles: 0
    tile_size: int  # tiles layout: vision image_size; patches: 0
    downsample_ratio: float  # tiles layout: pixel shuffle; patches: 0.0


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One checkpoint, read once. Build it with `open` or `demo`; it pickles (a rank gets a copy)."""

    name: str  # --model as given
    path: Path | None  # the directory; None when the weights come from `seed`
    config: Mapping[str, Any]  # config.json
    processor_config: Mapping[str, Any] | None  # the image processor's, found as from_pretrained finds it
    video_processor_config: (
        Mapping[str, Any] | None
    )  # the video processor's, found as from_pretrained finds it
    family: Family
    seed: int | None = None  # weights drawn from this seed instead of read from files (the demo)

    @classmethod
    def open(cls, name_or_path: str | Path, family: str = "auto") -> Checkpoint:
        """--model (a checkpoint directory, or "demo") and --model_family -> the Checkpoint. Refuses a
        directory with no config.json, an unknown or unloadable model_type, or a --model_family that
        contradicts it (check_servable refuses the rest before serving)."""
        if str(name_or_path) == DEMO:
            return cls.demo(family)
        path = Path(name_or_path)
        if not path.is_dir():
            raise ConfigError(
                f"--model {str(name_or_path)!r} is not a directory; give a local Hugging Face checkpoint "
                f"directory, or {DEMO}"
            )
        config = _read_json(path / CONFIG_FILE)
        if config is None:
            raise ConfigError(
                f"--model {str(path)!r} has no {CONFIG_FILE}; give a Hugging Face checkpoint directory"
            )
        found = _family(config, family, f"{CONFIG_FILE}'s model_type {config.get('model_type', '')!r} is")
        return cls(
            name=str(name_or_path),
            path=path,
            config=config,
            processor_config=_processor_config(path, "image_processor", PREPROCESSOR_FILE),
            video_processor_config=_processor_config(path, "video_processor", VIDEO_PREPROCESSOR_FILE),
            family=found,
        )

    @classmethod
    def demo(cls, family: str = "auto") -> Checkpoint:
        """The demo: a seeded, randomly initialised Qwen2.5-VL-shaped tower. Its embeddings mean nothing."""
        config = {"model_type": _DEMO_MODEL_TYPE, "vision_config": dict(_DEMO_VISION_CONFIG)}
        found = _family(config, family, f"--model {DEMO} is")
        return cls(DEMO, None, config, None, None, found, seed=_DEMO_SEED)

    # ------------------------------------------------------------------------------------ facts

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def vision(self) -> Mapping[str, Any]:
        """config.json's vision_config."""
        vision = self.config.get("vision_config")
        return vision if isinstance(vision, Mapping) else {}

    @property
    def model_name(self) -> str:
        """What responses and the wire call the model (model_name_of its directory)."""
        return self.name if self.path is None else model_name_of(self.path)

    @property
    def geometry(self) -> Geometry:
        f, vision = self.family, self.vision
        if f.layout == "tiles":
            return Geometry(
                patch_size=first_size(vision.get("patch_size", f.patch_size)),
                merge_size=0,
                temporal_patch_size=0,
                tile_size=first_size(vision.get("image_size", f.tile_size)),
                downsample_ratio=float(self.config.get("downsample_ratio", f.downsample_ratio)),
            )
        return Geometry(
            patch_size=first_size(vision.get("patch_size", f.patch_size)),
            merge_size=first_size(vision.get("spatial_merge_size", f.merge_size)),
            temporal_patch_size=first_size(vision.get("temporal_patch_size", f.temporal_patch_size)),
            tile_size=0,
            downsample_ratio=0.0,
        )

    def stated_grid(self) -> dict[str, int]:
        """Only what config.json itself states about the patch grid, for families.check_geometry (a key it
        leaves out is the tower class's default, which the processor is not checked against)."""
        keys = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"))
        return {key: first_size(self.vision[src]) for key, src in keys if src in self.vision}

    @property
    def text_hidden_size(self) -> int | None:
        """The language model's hidden size (text_config.hidden_size, or a flat config's hidden_size); None
        when config.json names none (the demo has no language model)."""
        text = self.config.get("text_config")
        hidden = (text if isinstance(text, Mapping) else self.config).get("hidden_size")
        return hidden if isinstance(hidden, int) and hidden > 0 else None

    @property
    def llm_embeds_width(self) -> int | None:
        """The width of the embedding rows the LLM server assumes: the language model's hidden size, times
        1 + the DeepStack levels for the families that concatenate them (Qwen3-VL); None without one."""
        if self.text_hidden_size is None:
            return None
        levels = len(self.vision.get("deepstack_visual_indexes") or []) if self.family.deepstack else 0
        return self.text_hidden_size * (1 + levels)

    def check_servable(self) -> None:
        """What the ranks would fail on: no vision_config (a language-model-only checkpoint), or no
        safetensors weights (vitserve reads only those, model/weights.py: one file, or shards and index)."""
        if not isinstance(self.config.get("vision_config"), Mapping):
            raise ConfigError(
                f"--model {self.name!r}: {CONFIG_FILE} has no vision_config; give the full {self.family.display} "
                "checkpoint (vision tower and language model), not a language-model-only one"
            )
        path = self.path
        if path is None or (path / SAFETENSORS_INDEX).is_file() or any(path.glob("*.safetensors")):
            return
        found = sorted(p.name for p in path.glob("*.bin"))
        what = (
            f"only PyTorch .bin files ({', '.join(found[:3])}), which vitserve does not read"
            if found
            else "no weights"
        )
        raise ConfigError(
            f"--model {str(path)!r} has {what}; give a checkpoint with *.safetensors weights "
            "(transformers' save_pretrained writes them by default)"
        )

    def digest(self) -> WeightsDigest:
        """An empty digest of this checkpoint's weights: the loader adds each vision tensor as it reads it.
        For a seeded checkpoint the configs and the seed are the whole content."""
        return WeightsDigest(self)


class WeightsDigest:
    """The content digest of a checkpoint's vision weights: what keys the stored reservation and the
    encoder-output caches (two hosts may mount different weights at one path, or one at two).

    sha256 over the canonical JSON of the configs (config.json, the image and video processor configs) and
    the seed, then over every vision tensor as (name, dtype, shape, sha256 of its bytes) in name order, so
    the order the loader reads shards and tensors in does not matter. The language model's tensors are
    never read, so they are not in it. Costs one sha256 pass over bytes the loader reads anyway (about
    0.6 GB/s on one core of the 2-core test machine: about 2 s for a 7B model's 1.3 GB tower).
    """

    def __init__(self, checkpoint: Checkpoint):
        self._head = {
            "config": checkpoint.config,
            "processor": checkpoint.processor_config,
            "video_processor": checkpoint.video_processor_config,
            "seed": checkpoint.seed,
        }
        self._tensors: dict[str, tuple[str, list[int], str]] = {}

    def add(self, name: str, dtype: str, shape: Sequence[int], data: bytes | memoryview) -> None:
        """One tensor: its checkpoint key, dtype name, shape and raw bytes (C order)."""
        self._tensors[name] = (dtype, [int(n) for n in shape], hashlib.sha256(data).hexdigest())

    def hexdigest(self) -> str:
        h = hashlib.sha256(_canonical(self._head))
        for name in sorted(self._tensors):
            h.update(_canonical([name, *self._tensors[name]]))
        return h.hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _family(config: Mapping[str, Any], flag: str, what: str) -> Family:
    """The family of config.json's model_type and --model_family. The flag wins for a model_type the
    registry does not know (a fine-tune with its own model_type names its tower with it); for one it knows,
    a flag naming another family is refused. `what`: how the message names the checkpoint's family."""
    model_type = str(config.get("model_type", ""))
    if flag in FAMILIES and model_type in MODEL_TYPES:
        found = family_of_model_type(model_type)
        if flag != found.name:
            raise ConfigError(
                f"--model_family {flag} does not match the checkpoint: {what} a {found.display} tower; "
                f"use --model_family {found.name} (or auto)"
            )
    return family_of_model_type(model_type, flag)  # refuses bad flags, unknown and unloadable model types


def _processor_config(path: Path, section_name: str, own_file: str) -> dict[str, Any] | None:
    """A processor's parameters in HF's order: processor_config.json's `section_name` section ("image_processor",
    "video_processor"), else its own file; None when the checkpoint ships neither (the family's defaults apply)."""
    combined = _read_json(path / PROCESSOR_FILE)
    section = (combined or {}).get(section_name)
    if isinstance(section, dict):
        return section
    return _read_json(path / own_file)


def _read_json(file: Path) -> dict[str, Any] | None:
    """A JSON object from a file, None when the file does not exist."""
    if not file.is_file():
        return None
    try:
        parsed = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: cannot read {file} ({exc}); fix the checkpoint") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"--model: {file} is not a JSON object; fix the checkpoint")
    return parsed
