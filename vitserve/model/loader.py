"""load_encoder: a checkpoint directory (or "demo") -> an Encoder holding only the vision tower."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vitserve.errors import ConfigError
from vitserve.families import DEMO_FAMILY
from vitserve.model.adapters import ADAPTERS, FamilyAdapter, resolve_adapter
from vitserve.model.encoder import HFVisionEncoder
from vitserve.model.weights import assign_weights, read_vision_weights, rebuild_rope_buffers

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

log = logging.getLogger(__name__)

# --dtype values and the aliases load_encoder also takes (not the wire's dtype names: rpc/tensors.py)
_DTYPE_ARGS = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def load_encoder(
    name_or_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    family: str = "auto",
) -> HFVisionEncoder:
    """Build the vision tower (+ merger/projector) of a checkpoint and read only its weights.

    name_or_path: a local HF checkpoint directory, or "demo" (seeded random Qwen2.5-VL-shaped tower).
    family: "auto" reads model_type from config.json; else one of vitserve.families.FAMILIES.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if str(name_or_path) == "demo":
        return _load_demo(device, dtype)
    path = Path(name_or_path)
    config_json = _read_config_json(path)
    adapter = resolve_adapter(config_json.get("model_type"), family)
    config = adapter.config_cls().from_pretrained(str(path))
    with torch.device("meta"):
        visual = adapter.build(config)
    weights = read_vision_weights(path, adapter.key_prefixes)
    assign_weights(visual, weights.tensors, path)
    log.info(
        "%s: %s vision tower, %d tensors read from %d file(s)",
        path,
        adapter.family,
        len(weights.tensors),
        len(weights.files_read),
    )
    return _finish(visual, adapter, config, model_name=model_name_of(path), device=device, dtype=dtype)


def _load_demo(device: torch.device, dtype: torch.dtype) -> HFVisionEncoder:
    from vitserve.model.demo import build_demo_visual, demo_config

    return _finish(build_demo_visual(), ADAPTERS[DEMO_FAMILY], demo_config(), "demo", device, dtype)


def _finish(
    visual: nn.Module,
    adapter: FamilyAdapter,
    config: PreTrainedConfig,
    model_name: str,
    device: torch.device,
    dtype: torch.dtype,
) -> HFVisionEncoder:
    rebuild_rope_buffers(visual, torch.device("cpu"))  # materialise what the checkpoint left on meta
    visual = visual.to(device=device, dtype=dtype).eval()
    rebuild_rope_buffers(visual, device)  # .to(dtype) cast them; HF keeps them float32
    visual = _optimize(visual, adapter.family)
    return HFVisionEncoder(
        visual,
        adapter,
        model_name=model_name,
        embed_dim=adapter.embed_dim(config),
        num_deepstack=adapter.num_deepstack(config),
        dtype=dtype,
        device=device,
    )


def _optimize(visual: nn.Module, family: str) -> nn.Module:
    """Swap slow HF pieces for exact faster ones, in place (vitserve.model.fast; equal to HF to fp32 round-off)."""
    from vitserve.model.fast import optimize

    return optimize(visual, family)


def model_name_of(path: Path) -> str:
    """The checkpoint directory's name; for a Hugging Face cache snapshot (models--org--name/snapshots/<sha>)
    the repo id "org/name", since the directory name there is a commit hash."""
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    return parts[-1]


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ConfigError(
            f"--model {str(path)!r} is not a directory (give a local checkpoint directory or 'demo')"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"--model {str(path)!r} has no config.json; give a Hugging Face checkpoint directory"
        )
    try:
        parsed: dict[str, Any] = json.loads(config_file.read_text())
        return parsed
    except ValueError as exc:
        raise ConfigError(f"{config_file} is not valid JSON ({exc}); check --model") from exc


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:N, auto)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """The dtype to run in; refuses one the device cannot compute in (names --dtype)."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if dtype not in _DTYPE_ARGS:
            raise ConfigError(f"--dtype {dtype!r} is not one of auto, {', '.join(_DTYPE_ARGS)}")
        dtype = _DTYPE_ARGS[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"--dtype {dtype} is not supported; use float32, bfloat16 or float16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError("--dtype bfloat16 is not supported by this GPU; use --dtype float16 or float32")
    try:  # the ops every tower needs: a matmul and a softmax in this dtype on this device
        x = torch.ones(2, 2, device=device, dtype=dtype)
        torch.softmax(x @ x, dim=-1)
    except RuntimeError as exc:
        raise ConfigError(
            f"--dtype {dtype} cannot run on --device {device} ({exc}); use --dtype float32"
        ) from exc
    return dtype
