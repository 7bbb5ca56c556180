"""The flags that say which model runs and where: the checkpoint, its family and dtype, the device and the
runtime directory."""

from __future__ import annotations

import re

from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.families import FAMILY_CHOICES
from vitserve.flags.spec import Flag

MODEL: dict[str, Flag] = {
    "model": Flag(
        str, "model", "local HF checkpoint directory, or 'demo' (random weights; embeddings mean nothing)"
    ),
    "model_family": Flag(str, "model", f"one of {', '.join(FAMILY_CHOICES)}"),
    "dtype": Flag(str, "model", "auto | float32 | bfloat16 | float16"),
}
RUNTIME: dict[str, Flag] = {
    "device": Flag(str, "runtime", "auto | cpu | cuda | cuda:N"),
    "runtime_dir": Flag(str, "runtime", "private runtime directory (ipc sockets, reservation files)"),
}


def validate(config: Config) -> None:
    if config.model_family not in FAMILY_CHOICES:
        raise ConfigError(f"--model_family {config.model_family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {config.dtype!r} is not one of auto, float32, bfloat16, float16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f"--device {config.device!r} is not one of auto, cpu, cuda, cuda:N")
