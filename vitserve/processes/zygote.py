"""A warm forkserver for the encoder ranks: their imports run beside the API process's, not after them.

A spawned rank starts a new interpreter and imports torch, zmq and transformers' modeling code for its
family before it can build the tower: ~7 s of CPU on a 2-core machine, and they began only once the API
process had imported torch and transformers for its image processor (another ~7 s). `start()` launches
multiprocessing's forkserver first thing in `vitserve` (after the flags and the start-up checks) with
those modules as its preload, so both import chains run at once; the ranks are then forked from it with
everything imported (bench/startup.py: the rank's "loading weights" phase for the demo went 4.6 s -> 0.5 s).

The forkserver is a fresh interpreter started before any thread or CUDA context exists in it, so forking
it is safe. It dies with the service: the first module it imports (`vitserve.processes.guard`)
asks Linux to kill it when its parent exits (it would otherwise finish its preload first), and once
serving it exits when the service's end of its pipe closes. A rank forked from it watches the forkserver
as its parent (process.watched_parent).

Without `start()` (library use) ranks are spawned as before; `vitserve.processes.context()` says which,
for the ranks (engine/groups.py) and the video decoders alike. The tests call `start()` once per session
(tests/conftest.py), so their in-process engines fork ranks from it as the CLI's do.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import re

from vitserve import processes
from vitserve.checkpoint import Checkpoint
from vitserve.processes.guard import SERVICE_PID_ENV  # does nothing outside the forkserver


def preload_modules(checkpoint: Checkpoint) -> list[str]:
    """What the forkserver imports: the guard first, then the rank's modules and the family's HF modeling."""
    modules = ["vitserve.processes.guard", "vitserve.worker.process", "vitserve.model.loader"]
    model_type = checkpoint.model_type
    if re.fullmatch(r"[a-z0-9_]+", model_type):  # a module that does not exist is skipped (ImportError)
        modules.append(f"transformers.models.{model_type}.modeling_{model_type}")
    return modules


def start(checkpoint: Checkpoint) -> None:
    """Launch the forkserver now (it returns at once; the preload runs in the background)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules(checkpoint))
    os.environ[SERVICE_PID_ENV] = str(os.getpid())  # read (and dropped) by the guard in the forkserver
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(SERVICE_PID_ENV, None)
    processes.use_warm_forkserver()  # the video decoders fork from it too
