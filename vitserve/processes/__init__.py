"""Where vitserve's helper processes come from, in one package: the encoder ranks and the video decoders
(`context()`), the ranks' warm forkserver (`zygote.py`) and the guard it imports first (`guard.py`).

Once the CLI started the warm forkserver (vitserve/processes/zygote.py), they are forked from it with torch and
the rank's modules already imported: a video decoder starts in ~0.1 s instead of the ~3.5 s of CPU a new
interpreter spends importing torch and PyAV, and a rank skips its ~7 s of imports. Without it (library use),
each is spawned, a new interpreter that imports what it needs.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext, SpawnContext

_warm = False


def use_warm_forkserver() -> None:
    """Called by zygote.start once the forkserver runs with its preload."""
    global _warm
    _warm = True


def context() -> ForkServerContext | SpawnContext:
    """The warm forkserver once zygote.start ran, else a spawned interpreter."""
    return mp.get_context("forkserver") if _warm else mp.get_context("spawn")
