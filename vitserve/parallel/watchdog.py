"""The engine's watchdog: finds dead, hung or failed ranks well before --dist_timeout_s.

Checked every min(heartbeat_s / 4, 0.5) s: a rank whose process exited (SIGKILL, crash, its own exit
after reporting an error), or a ready rank silent for more than 2 x heartbeat_s (SIGSTOP, a wedged
host). `WorkerGroup.fault` says which; the callback fails the group's work and tears it down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from vitserve.parallel.pool import WorkerGroup

log = logging.getLogger(__name__)


async def watch(groups: Sequence[WorkerGroup], heartbeat_s: float,
                on_fault: Callable[[WorkerGroup, str], None]) -> None:
    period = min(heartbeat_s / 4, 0.5)
    last_tick = time.monotonic()
    while True:
        now = time.monotonic()
        stalled = now - last_tick > period + heartbeat_s / 2
        last_tick = now
        for group in groups:
            if not group.alive:
                continue
            # After our own event loop was blocked, ALIVE reports may still sit unread in the status socket:
            # judge silence on the next tick, once the reader caught up (exits are judged right away).
            try:
                reason = group.fault(now, silence=not stalled)
                if reason is not None:
                    on_fault(group, reason)
            except Exception:  # keep watching the other groups; a dead watchdog would hide every fault
                log.exception("watchdog check of group %d failed", group.index)
        await asyncio.sleep(period)
