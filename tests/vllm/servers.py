"""The real vLLMs tests/vllm/test_front_door.py runs against, one per servable family plus Qwen2.5-VL without
its tower ("bare"), each with its tiny checkpoint: started at once, without waiting for them.

A start-up is ~1 minute of mostly one core's Python (~58 CPU-s: vLLM's CPU platform spawns its engine and
worker processes, and each imports vLLM again). So a serial run starts them early, when tests/unit begins
(tests/unit/conftest.py): those tests run in the pytest process on one core, the start-ups take the other,
and tests/vllm, collected after tests/unit, finds them ready instead of waiting for them. `take` hands the
early ones over, or starts them then.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.checkpoints import SERVABLE_FAMILIES, make_servable_checkpoint
from tests.vllm_server import VllmServer, vllm_venv_python

CHECKPOINT_MAX_UNITS = 512  # the checkpoints' max_pixels in merge units (what vLLM alone allows)

# family (or "bare") -> (checkpoint, its directory, the server)
Servers = dict[str, tuple[Path, Path, VllmServer]]

_early: Servers | None = None


def start(root: Path) -> Servers:
    """Start every server (they get ready in the background; VllmServer.wait_ready waits for one)."""
    started: Servers = {}
    try:
        for family in SERVABLE_FAMILIES:
            tmp = root / family
            tmp.mkdir(parents=True)
            ckpt = make_servable_checkpoint(family, tmp / family, max_units=CHECKPOINT_MAX_UNITS)
            started[family] = (
                ckpt,
                tmp,
                VllmServer(
                    ckpt,
                    tmp,
                    limit_mm={"image": 4, "video": 1},
                    extra_args=("--media-io-kwargs", json.dumps({"video": {"num_frames": -1}})),
                    wait=False,
                ),
            )
        ckpt, tmp, _ = started["qwen2_5_vl"]
        started["bare"] = ckpt, tmp, VllmServer(ckpt, tmp, limit_mm={"image": 0, "video": 0}, wait=False)
    except BaseException:
        stop(started)
        raise
    return started


def stop(servers: Servers) -> None:
    for _, _, server in servers.values():
        server.stop()


def start_early(root: Path) -> None:
    """Start them now for a later `take`, if the vLLM venv is there (without it tests/vllm skips, or fails in
    CI, when it begins)."""
    global _early
    if _early is None and vllm_venv_python().is_file():
        _early = start(root)


def take(root: Path) -> Servers:
    """The servers started early, else new ones under `root`; the caller stops them (`stop`)."""
    global _early
    servers, _early = _early, None
    return servers if servers is not None else start(root)


def stop_early() -> None:
    """Stop servers started early that no test took (tests/vllm deselected after all, or the run ended)."""
    global _early
    if _early is not None:
        stop(_early)
        _early = None
