"""The real vLLMs with vitserve's own encoder-cache connector (vitserve/connector/glue.py, docs/vllm.md) that
tests/vllm's connector tests share: Qwen3-VL (DeepStack; its tower kept, so it also answers raw images) for
every case, and Qwen2.5-VL (no DeepStack, its video in time-windowed rows) for the answers of the other family,
`--ec-transfer-config` naming `vitserve.vllm_connector` by module path, vitserve importable there only as its own
package (PYTHONPATH to a directory holding nothing but `vitserve`: what `pip install --no-deps vitserve` gives,
and vLLM's packages untouched), the connector's port on loopback TCP, its files in a directory of its own, a
key file, a small byte bound and a short wait.

The Qwen3-VL one also runs vLLM's `--mm-processor-cache-type shm` (raw images reach the scheduler as shared-memory
addresses, metadata-only parts as their grid alone: the connector tells them apart as vLLM's parser declares
them), and keeps its tensors on a tmpfs of SHM_BYTES (mounted here; we are root in tests and CI) far smaller than
its max_gb, as in a container with Docker's small /dev/shm: the device, not max_gb, is what fills up. Where the
mount fails it falls back to a plain directory and max_gb MAX_GB (`shm_mounted` False; the tests of a full
device skip).

tests/vllm/conftest.py's session fixture `connector_vllm` takes the Qwen3-VL one, tests/vllm/test_wire.py the
Qwen2.5-VL one (both started early beside the other vLLMs, tests/vllm/servers.py `take_more`).

The two run the connector in vLLM's two process layouts (tests/vllm_server.py): Qwen3-VL's worker in a process
of its own (vLLM's CPU default, as with tensor parallelism: the worker side reads what the scheduler side wrote
in another process), Qwen2.5-VL's inside the engine core (as on one GPU: both sides of the connector in one
process).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.checkpoints import make_servable_checkpoint
from tests.ports import unused_port
from tests.vllm_server import VllmServer, vllm_python

FAMILY = "qwen3_vl"
SECRET = b"a test secret of 32 bytes, fixed"
MAX_GB = 0.00005  # ~52 KiB: a few 128x96 images' tensors (12 rows x 192 floats, 9 KiB), not a 120-row one
WAIT_S = 3.0  # the connector's wait_s: how long a request whose items never came is deferred, and a fetch's deadline
# (1 s was too short for a first keyed fetch on a loaded 2-core machine: one pull behind nginx failed in 4 runs)
SHM_BYTES = 80 * 1024  # the Qwen3-VL connector's tmpfs: 20 pages, a few small images' tensors
SHM_MAX_GB = 1  # its max_gb: far more than the device holds
_MADE: dict[str, Path] = {}  # family -> the first checkpoint made for it in this process
PULL_WAIT_S = (
    5.0  # the data-parallel one's wait_s: a fetch's deadline (the first fetches on a loaded machine)
)


@dataclass
class ConnectorVllm:
    ckpt: Path
    endpoint: str  # the connector's ZMQ address (vitserve's --llm_endpoint)
    key_file: Path  # its key_file (vitserve's --wire_key_file)
    server: VllmServer
    shm_dir: Path  # where its tensors live (a tmpfs of SHM_BYTES when shm_mounted)
    shm_mounted: bool = False

    @property
    def model(self) -> str:
        return str(self.ckpt)


def prepare(tmp: Path, family: str = FAMILY, data_parallel: int = 1) -> Callable[[bool], ConnectorVllm]:
    """Make one for `family` under `tmp`: its checkpoint, key and directories now; its start, waiting until it
    is ready or not, is what comes back (tests/vllm/servers.py starts it on a thread of its own).
    `data_parallel` > 1: that many engine cores (--data-parallel-size), each with its connector, which fetches
    (pull) and takes pushes pinned to its core (`dp_push`: core i binds `endpoint`'s port + i, for vitserve
    --llm_transport wire --llm_dp_size; tests/vllm/test_pull.py) keyed by `wire_security` tag, serving the checkpoint an earlier one of its
    family made (the same weights and model name, so a balancer may send a request to either)."""
    ckpt = _MADE.get(family) if data_parallel > 1 else None
    if ckpt is None:
        ckpt = make_servable_checkpoint(family, tmp / family, max_units=512)
        _MADE.setdefault(family, ckpt)
    vitserve_alone(tmp)
    key_file = tmp / "key"
    key_file.write_bytes(SECRET + b"\n")
    shm_dir = _tmpfs(SHM_BYTES) if family == FAMILY else None
    mounted = shm_dir is not None
    if shm_dir is None:
        shm_dir = tmp / "shm"
        shm_dir.mkdir()
    endpoint = (
        f"tcp://127.0.0.1:{_unused_ports(data_parallel)}"  # vLLM binds it (and the next) a minute later
    )
    config = {
        "ec_connector": "VitserveECConnector",
        "ec_connector_module_path": "vitserve.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {
            "endpoint": endpoint,
            "max_gb": SHM_MAX_GB if mounted else MAX_GB,
            "key_file": str(key_file),
            "wait_s": WAIT_S,
            "shm_dir": str(shm_dir),
        },
    }
    if data_parallel > 1:
        extra = config["ec_connector_extra_config"]
        extra["dp_push"] = (
            True  # core i binds the port + i; vitserve --llm_dp_size pins each request to a core
        )
        extra["wait_s"] = PULL_WAIT_S
        # its pushes keyed by a tag per message instead of CURVE (vitserve --wire_security tag): the one real vLLM
        # whose connector takes them; its pulls are CURVE as every connector's
        extra["wire_security"] = "tag"

    def launch(wait: bool) -> ConnectorVllm:
        server = VllmServer(
            ckpt,
            tmp,
            limit_mm={"image": 4, "video": 1},  # tests/vllm/test_wire.py sends a video through vitserve
            # and compares vLLM's own video path, which takes the sampling per request (media_io_kwargs)
            extra_args=(
                "--ec-transfer-config",
                json.dumps(config),
                "--trust-request-mm-kwargs",
                *(("--mm-processor-cache-type", "shm") if family == FAMILY else ()),
                *(("--data-parallel-size", str(data_parallel)) if data_parallel > 1 else ()),
            ),
            extra_env={"PYTHONPATH": os.fspath(tmp / "pkg")},
            wait=wait,
            worker_in_engine_core=family != FAMILY and data_parallel == 1,
        )
        return ConnectorVllm(ckpt, endpoint, key_file, server, shm_dir, mounted)

    return launch


def _unused_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now (the data-parallel cores' endpoints)."""
    for _ in range(100):
        first = unused_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first + 1, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free TCP ports")


def _tmpfs(size: int) -> Path | None:
    """A fresh tmpfs of `size` bytes, unmounted and removed when this process exits (after the servers
    stopped); None where mounting is not allowed. Not under pytest's basetemp: pytest moves old basetemps
    aside to delete them, and a mount inside one would move with it."""
    where = Path(tempfile.mkdtemp(prefix="vitserve-test-shm-"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", os.fspath(where)]
    try:
        done = subprocess.run(mount, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        where.rmdir()
        return None
    atexit.register(_unmount, where)
    return where


def _unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", os.fspath(where)], capture_output=True, timeout=30)
    shutil.rmtree(where, ignore_errors=True)


def vitserve_alone(tmp: Path) -> Path:
    """`tmp`/pkg holding only vitserve's package (a link to this tree's): vLLM's venv with it on PYTHONPATH is
    vLLM with `pip install --no-deps` of this checkout, as docs/vllm.md installs it."""
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "vitserve").symlink_to(Path(__file__).resolve().parents[2] / "vitserve")
    return tmp / "pkg"


def start_glue(tmp: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `script` (python -c) in a fresh interpreter of vLLM's venv, vitserve's package alone on its path, as
    vLLM's engine core runs the connector's glue (not a whole vLLM start-up: a minute of the suite's two cores);
    what it printed, once it exited 0."""
    env = {"PYTHONPATH": str(vitserve_alone(tmp)), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [str(vllm_python()), "-c", script, str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out
