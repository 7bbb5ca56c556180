"""The real vLLMs tests/vllm/test_front_door.py runs against, one per servable family plus Qwen2.5-VL without
its tower ("bare"), each with its tiny checkpoint: started at once, without waiting for them.

Every one is an encoder-cache consumer (docs/vllm.md) of `ec_dir(tmp)`, so the same servers take vitserve's
inline embeddings, raw media, and --llm_transport ec_storage's files (a consumer still does the first two:
the inline tests run against consumers). They take per-request `media_io_kwargs` (--trust-request-mm-kwargs)
instead of a server-wide --media-io-kwargs, which vLLM would hash into every video uuid (handover/ec_storage.py).
"plain" is the one vLLM that is not a consumer (Qwen2.5-VL without a tower, the cheapest to start): it is
what refuses ec_storage's metadata-only parts, and no consumer can show that.

A start-up is mostly one core's Python: vLLM's CPU platform spawns an engine-core and a worker process, and each
imports vLLM again (~58 CPU-s, ready in ~53 s on an idle machine). These run with the worker inside the engine
core (`worker_in_engine_core`, the layout vLLM has on one GPU): ~40 CPU-s, ready in ~37 s; six start-ups,
these four and tests/vllm/connector_server.py's two, ~4.5 CPU-min. A serial run of the whole suite
starts them when it begins (tests/conftest.py), one after another on a thread of their own
(`start_in_background`): tests/e2e and tests/integration leave 30-50% of the two cores idle (they wait on
processes, sockets and timers), which the start-ups fill, and tests/vllm, last, finds them ready. One at a
time: all six at once put ~35 processes on two cores and stall the tests running then. Measured (bench/RESULTS.md
"The test suite"): 1,039 s of pytest this way against 1,074 s with all six at the first unit test; at nice 19
it was slower (tests/e2e 470 s against 420 s), so they run at normal priority. `take` and
`take_more` hand them over, or start them then (a run of tests/vllm alone).
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.checkpoints import SERVABLE_FAMILIES, make_servable_checkpoint
from tests.vllm import connector_server
from tests.vllm_server import VllmServer, vllm_venv_python

CHECKPOINT_MAX_UNITS = 512  # the checkpoints' max_pixels in merge units (what vLLM alone allows)
NO_TOWER = {"image": 0, "video": 0}

# family (or "bare", "plain") -> (checkpoint, its directory, the server)
Servers = dict[str, tuple[Path, Path, VllmServer]]
Launch = Callable[[], tuple[Path, Path, VllmServer]]  # starts one server, not waiting for it

_early: Servers | None = None
# The other modules' own vLLMs, started early beside these and taken once each (`take_more`): vitserve's
# connector, one per family (tests/vllm/connector_server.py).
_early_more: dict[str, connector_server.ConnectorVllm] = {}
_starter: threading.Thread | None = None  # start_in_background's thread
_stopping = threading.Event()  # the run ends: start no more


class _Abandoned(Exception):
    """The run ended while the servers were still being started one by one."""


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


def _server(ckpt: Path, tmp: Path, limit_mm: dict[str, int], consumer: bool) -> tuple[Path, Path, VllmServer]:
    args = consumer_args(tmp) if consumer else ()
    server = VllmServer(ckpt, tmp, limit_mm=limit_mm, extra_args=args, wait=False, worker_in_engine_core=True)
    return ckpt, tmp, server


def _launches(root: Path) -> dict[str, Launch]:
    """Every server's start, its checkpoint made now, in the calling thread (a checkpoint is built with
    torch's global RNG and default dtype, which a test running meanwhile on the main thread may be using)."""
    launches: dict[str, Launch] = {}
    made: dict[str, tuple[Path, Path]] = {}  # family -> its checkpoint, its directory
    for family in SERVABLE_FAMILIES:
        tmp = root / family
        tmp.mkdir(parents=True)
        ckpt = make_servable_checkpoint(family, tmp / family, max_units=CHECKPOINT_MAX_UNITS)
        launches[family] = functools.partial(_server, ckpt, tmp, {"image": 4, "video": 1}, True)
        made[family] = ckpt, tmp
    ckpt, tmp = made["qwen2_5_vl"]  # the same checkpoint, served without its tower
    launches["bare"] = functools.partial(_server, ckpt, tmp, NO_TOWER, True)
    launches["plain"] = functools.partial(_server, ckpt, tmp, NO_TOWER, False)
    return launches


def _launched(server: VllmServer, serially: bool) -> None:
    """When starting `serially`, wait until `server` is ready (a failed start-up is the taking test's to
    report: its wait_ready raises again, with vLLM's log)."""
    if serially:
        if _stopping.is_set():
            server.stop()
            raise _Abandoned
        with contextlib.suppress(RuntimeError):
            server.wait_ready()


def _start(launches: dict[str, Launch], serially: bool) -> Servers:
    started: Servers = {}
    try:
        for name, launch in launches.items():
            started[name] = launch()
            _launched(started[name][2], serially)
    except BaseException:
        stop(started)
        raise
    return started


def start(root: Path) -> Servers:
    """Start every server at once (they get ready in the background; VllmServer.wait_ready waits for one)."""
    return _start(_launches(root), serially=False)


MORE: dict[str, Callable[[Path], Callable[[bool], connector_server.ConnectorVllm]]] = {
    "connector": connector_server.prepare,
    "connector_qwen2_5_vl": functools.partial(connector_server.prepare, family="qwen2_5_vl"),
    # tests/vllm/test_pull.py: two data-parallel engine cores fetching (pull), beside the one above behind nginx
    "connector_dp": functools.partial(connector_server.prepare, family="qwen2_5_vl", data_parallel=2),
}


def take_more(name: str, root: Path) -> connector_server.ConnectorVllm:
    """The `MORE[name]` server started early, else one started now under `root` (not waited for)."""
    _join_starter()
    started = _early_more.pop(name, None)
    return started if started is not None else MORE[name](root)(False)


def stop(servers: Servers) -> None:
    for _, _, server in servers.values():
        server.stop()


def start_in_background(root: Path) -> None:
    """Start them all, one after another, on a thread, for a later `take` / `take_more`, if the vLLM venv is
    there (without it tests/vllm skips, or fails in CI, when it begins). Their checkpoints are made now."""
    global _starter
    if _starter is not None or not vllm_venv_python().is_file():
        return
    launches = _launches(root)
    more = {}
    for name, prepare in MORE.items():
        (root / name).mkdir()
        more[name] = prepare(root / name)
    _starter = threading.Thread(target=_start_all, args=(launches, more), name="vllm-start-ups", daemon=True)
    _starter.start()


def _start_all(launches: dict[str, Launch], more: dict[str, Callable[[bool], Any]]) -> None:
    global _early
    with contextlib.suppress(_Abandoned):
        _early = _start(launches, serially=True)
        for name, launch in more.items():
            _early_more[name] = launch(False)
            _launched(_early_more[name].server, serially=True)


def _join_starter() -> None:
    if _starter is not None:
        _starter.join()


def take(root: Path) -> Servers:
    """The servers started early, else new ones under `root`; the caller stops them (`stop`)."""
    global _early
    _join_starter()
    servers, _early = _early, None
    return servers if servers is not None else start(root)


def stop_early() -> None:
    """Stop servers started early that no test took (tests/vllm deselected after all, or the run ended)."""
    global _early
    _stopping.set()
    _join_starter()
    if _early is not None:
        stop(_early)
        _early = None
    for started in _early_more.values():
        started.server.stop()
    _early_more.clear()
