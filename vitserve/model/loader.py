"""load_encoder: a checkpoint (vitserve/checkpoint.py) -> an Encoder holding only the vision tower."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitserve.checkpoint import Checkpoint
from vitserve.errors import ConfigError
from vitserve.model.adapters import FamilyAdapter, resolve_adapter
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
    source: Checkpoint | str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    family: str = "auto",
) -> HFVisionEncoder:
    """Build the vision tower (+ merger/projector) of a checkpoint and read only its weights, hashing each
    vision tensor as it is read (the encoder's `weights_digest`: checkpoint.WeightsDigest).

    source: the opened checkpoint, or a --model value (a local HF checkpoint directory, or the demo).
    family: --model_family for a --model value ("auto": config.json's model_type decides).
    """
    checkpoint = source if isinstance(source, Checkpoint) else Checkpoint.open(source, family)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    adapter = resolve_adapter(checkpoint.model_type, checkpoint.family.name)
    config = adapter.hf_config(checkpoint.config)
    digest = checkpoint.digest()
    if checkpoint.path is None:  # no weight files: drawn from the checkpoint's seed
        from vitserve.model.demo import seeded_visual

        visual = seeded_visual(adapter, config, checkpoint)
    else:
        with torch.device("meta"):
            visual = adapter.build(config)
        weights = read_vision_weights(checkpoint.path, adapter.key_prefixes, digest)
        assign_weights(visual, weights.tensors, checkpoint.path)
        log.info(
            "%s: %s vision tower, %d tensors read from %d file(s)",
            checkpoint.path,
            adapter.family,
            len(weights.tensors),
            len(weights.files_read),
        )
    return _finish(visual, adapter, config, checkpoint.model_name, device, dtype, digest.hexdigest())


def _finish(
    visual: nn.Module,
    adapter: FamilyAdapter,
    config: PreTrainedConfig,
    model_name: str,
    device: torch.device,
    dtype: torch.dtype,
    weights_digest: str,
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
        weights_digest=weights_digest,
    )


def _optimize(visual: nn.Module, family: str) -> nn.Module:
    """Swap slow HF pieces for exact faster ones, in place (vitserve.model.fast; equal to HF to fp32 round-off)."""
    from vitserve.model.fast import optimize

    return optimize(visual, family)


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
