"""The real vLLMs tests/vllm/test_front_door.py runs against, one per servable family plus Qwen2.5-VL without
its tower ("bare"), each with its tiny checkpoint: started at once, without waiting for them.

Every one is an encoder-cache consumer (docs/vllm.md) of `ec_dir(tmp)`, so the same servers take vitserve's
inline embeddings, raw media, and --llm_transport ec_storage's files (a consumer still does the first two:
the inline tests run against consumers). They take per-request `media_io_kwargs` (--trust-request-mm-kwargs)
instead of a server-wide --media-io-kwargs, which vLLM would hash into every video uuid (handover/ec_storage.py).
"plain" is the one vLLM that is not a consumer (Qwen2.5-VL without a tower, the cheapest to start): it is
what refuses ec_storage's metadata-only parts, and no consumer can show that.

A start-up is ~1 minute of mostly one core's Python (~58 CPU-s: vLLM's CPU platform spawns its engine and
worker processes, and each imports vLLM again). So a serial run starts them early, when tests/unit begins
(tests/unit/conftest.py): those tests run in the pytest process on one core, the start-ups take the other,
and tests/vllm, collected after tests/unit, finds them ready instead of waiting for them. `take` hands the
early ones over, or starts them then.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.checkpoints import SERVABLE_FAMILIES, make_servable_checkpoint
from tests.vllm import connector_server
from tests.vllm_server import VllmServer, vllm_venv_python

CHECKPOINT_MAX_UNITS = 512  # the checkpoints' max_pixels in merge units (what vLLM alone allows)

# family (or "bare", "plain") -> (checkpoint, its directory, the server)
Servers = dict[str, tuple[Path, Path, VllmServer]]

_early: Servers | None = None
# The other modules' own vLLMs, started early beside these and taken once each (`take_more`): vitserve's
# connector, one per family (tests/vllm/connector_server.py). Each is ~1 minute of a core that a serial run
# would otherwise wait for when its first test begins.
_early_more: dict[str, Any] = {}


def ec_dir(tmp: Path) -> Path:
    """The consumer's shared_storage_path for the servers under `tmp` (bare shares its family's)."""
    return tmp / "ec"


def consumer_args(tmp: Path) -> tuple[str, ...]:
    config = {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": str(ec_dir(tmp))},
    }
    return ("--ec-transfer-config", json.dumps(config), "--trust-request-mm-kwargs")


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
                    extra_args=consumer_args(tmp),
                    wait=False,
                ),
            )
        ckpt, tmp, _ = started["qwen2_5_vl"]
        no_tower = {"image": 0, "video": 0}
        bare = VllmServer(ckpt, tmp, limit_mm=no_tower, extra_args=consumer_args(tmp), wait=False)
        started["bare"] = ckpt, tmp, bare
        started["plain"] = ckpt, tmp, VllmServer(ckpt, tmp, limit_mm=no_tower, wait=False)
    except BaseException:
        stop(started)
        raise
    return started


MORE: dict[str, Callable[[Path, bool], Any]] = {
    "connector": connector_server.start,
    "connector_qwen2_5_vl": functools.partial(connector_server.start, family="qwen2_5_vl"),
}


def take_more(name: str, root: Path) -> Any:
    """The `MORE[name]` server started early, else one started now under `root` (not waited for)."""
    started = _early_more.pop(name, None)
    return started if started is not None else MORE[name](root, False)


def stop(servers: Servers) -> None:
    for _, _, server in servers.values():
        server.stop()


def start_early(root: Path) -> None:
    """Start them now for a later `take`, if the vLLM venv is there (without it tests/vllm skips, or fails in
    CI, when it begins)."""
    global _early
    if _early is None and vllm_venv_python().is_file():
        _early = start(root)
        for name, start_one in MORE.items():
            (root / name).mkdir()
            _early_more[name] = start_one(root / name, False)


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
    for started in _early_more.values():
        (started.server if hasattr(started, "server") else started[2]).stop()
    _early_more.clear()
