"""What the tests of vitserve in front of a real vLLM share (tests/vllm/test_front_door.py and the
--llm_transport ec_storage cases of tests/vllm/ec_cases.py): the stack of one family, the vitserve CLI in front
of its vLLM, test images, and a metric read from /metrics."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from tests.cli import Cli
from tests.e2e.live import InProcess, cli_in_process
from tests.vllm_server import VllmServer

BUDGET = 256  # vitserve's per-image budget, below the checkpoints' own limit


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A smooth colour field with noise: resizing it changes pixels (unlike a flat colour)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Stack:
    family: str
    ckpt: Path
    vllm: VllmServer
    vitserve: Cli
    tmp: Path

    @property
    def model(self) -> str:
        return str(self.ckpt)


def cli_args(ckpt: Path, llm_url: str, *extra: str) -> list[str]:
    args = [
        "--model",
        str(ckpt),
        "--port",
        "0",
        "--llm_url",
        llm_url,
        "--visual_batch_max_tokens",
        str(BUDGET),
    ]
    return [*args, "--device", "cpu", "--heartbeat_s", "5", "--dist_timeout_s", "120", *extra]


def start_vitserve(ckpt: Path, llm_url: str, tmp: Path, *extra: str) -> Cli:
    """The real `vitserve` CLI in front of `llm_url`, ready."""
    server = Cli(cli_args(ckpt, llm_url, *extra), tmp)
    server.wait_ready(300)
    return server


def vitserve_in_process(
    ckpt: Path, llm_url: str, tmp: Path, *extra: str
) -> contextlib.AbstractContextManager[InProcess]:
    """start_vitserve's service run in this process (tests/e2e/live.py cli_in_process): the ec_storage cases
    and those whose subject is the upstream vLLM (one without its tower, one that is no consumer) use it; each
    family's inline stack runs the CLI itself (start_vitserve), so the process, its flags and its exit stay
    covered."""
    return cli_in_process(cli_args(ckpt, llm_url, *extra), tmp)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
