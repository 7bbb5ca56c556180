"""Read only the vision weights of a checkpoint from safetensors, and finish a module built on meta."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from vitserve.checkpoint import SAFETENSORS_INDEX, WeightsDigest
from vitserve.errors import ConfigError


@dataclass
class VisionWeights:
    tensors: dict[str, torch.Tensor]  # module key -> tensor (CPU, checkpoint dtype)
    files_read: list[Path] = field(default_factory=list)  # every shard this module opened, in order


def _module_key(key: str, prefixes: tuple[tuple[str, str], ...]) -> str | None:
    for ckpt_prefix, module_prefix in prefixes:
        if key.startswith(ckpt_prefix):
            return module_prefix + key[len(ckpt_prefix) :]
    return None


def _shards_with_vision(path: Path, prefixes: tuple[tuple[str, str], ...]) -> list[Path]:
    """The shards to open: with an index, only those holding a vision key; else every *.safetensors file."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{index} is not a valid safetensors index ({exc}); check --model") from exc
        names = sorted({f for k, f in weight_map.items() if _module_key(k, prefixes) is not None})
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def read_vision_weights(
    path: Path, prefixes: tuple[tuple[str, str], ...], digest: WeightsDigest | None = None
) -> VisionWeights:
    """Every tensor under the vision prefixes, renamed to the module's keys. Other tensors are never read.
    Each one read is added to `digest` under its checkpoint key (the content digest costs no second read)."""
    shards = _shards_with_vision(path, prefixes)
    if not shards:
        raise ConfigError(f"no safetensors weights of the vision tower in {path}; check --model")
    out = VisionWeights(tensors={})
    for shard in tqdm(shards, desc="vision weights", unit="shard", disable=len(shards) < 2):
        if not shard.is_file():
            raise ConfigError(f"{shard} is listed in {SAFETENSORS_INDEX} but missing; check --model")
        out.files_read.append(shard)
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not dict-like
                module_key = _module_key(key, prefixes)
                if module_key is not None:
                    out.tensors[module_key] = tensor = handle.get_tensor(key)
                    if digest is not None:
                        _add(digest, key, tensor)
    if not out.tensors:
        wanted = ", ".join(p for p, _ in prefixes)
        raise ConfigError(f"{path} holds no vision weights (looked for keys under {wanted}); check --model")
    return out


def _add(digest: WeightsDigest, key: str, tensor: torch.Tensor) -> None:
    """The tensor's bytes as the file holds them (safetensors: C order, little-endian)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()  # a view: no copy
    digest.add(key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw.data)


def assign_weights(module: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Load into a meta-built module (assign=True: no second copy); every parameter must come from the file."""
    expected = set(module.state_dict().keys())
    missing = sorted(expected - tensors.keys())
    # Old checkpoints may carry rotary inv_freq tensors; they are rebuilt from the config instead.
    unexpected = sorted(k for k in tensors.keys() - expected if not k.endswith("inv_freq"))
    if missing or unexpected:
        raise ConfigError(
            f"vision weights in {source} do not match the model config: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}; check --model (and --model_family)"
        )
    module.load_state_dict({k: tensors[k] for k in expected}, strict=True, assign=True)


def _few(keys: list[str], limit: int = 5) -> str:
    if not keys:
        return "none"
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def rebuild_rope_buffers(module: nn.Module, device: torch.device) -> None:
    """(Re)compute the non-persistent buffers, which checkpoints do not store, in float32 on `device`.

    The only ones in these towers are the rotary `inv_freq` / `original_inv_freq`; they are recomputed the
    way transformers' own _init_weights does. They stay float32 whatever the model dtype, as in a model
    from_pretrained builds (the rotary forward computes in float32 anyway). Any other buffer still on meta
    is a bug in the loader and raises.
    """
    for name, sub in module.named_modules():
        rope = [n for n in ("inv_freq", "original_inv_freq") if isinstance(sub._buffers.get(n), torch.Tensor)]
        if rope and hasattr(sub, "rope_type"):
            init = getattr(sub, f"compute_{sub.rope_type}_rope_parameters", None)
            if init is None:
                raise RuntimeError(f"no rope init for rope_type {sub.rope_type!r} in {type(sub).__name__}")
            inv_freq, _ = init(sub.config)
            for buffer in rope:
                setattr(sub, buffer, inv_freq.to(device=device, dtype=torch.float32).clone())
        meta = [n for n, b in sub.named_buffers(recurse=False) if b.is_meta]
        if meta:
            raise RuntimeError(f"cannot rebuild buffers {meta} of {name or 'root'} ({type(sub).__name__})")
