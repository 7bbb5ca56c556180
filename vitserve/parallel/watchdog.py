"""The engine's watchdog: finds dead, hung or failed ranks well before --dist_timeout_s.

Checked every min(heartbeat_s / 4, 0.5) s: a rank whose process exited (SIGKILL, crash, its own exit
after reporting an error), or a ready rank silent for more than 2 x heartbeat_s (SIGSTOP, a wedged
host). `WorkerGroup.fault` says which; the callback fails the group's work and tears it down.

Silence is judged on the engine's event loop, where ALIVE reports are read. When that loop itself was
blocked, reports may sit unread in the socket; silence is then judged one tick later, after the reader
caught up (`loop_stalled`), so a busy API process does not kill healthy ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from vitserve.parallel.pool import WorkerGroup

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, groups: Sequence[WorkerGroup], heartbeat_s: float,
                 on_fault: Callable[[WorkerGroup, str], None]):
        self.groups = groups
        self.period = min(heartbeat_s / 4, 0.5)
        self._stall_limit = self.period + heartbeat_s / 2
        self._on_fault = on_fault
        self.last_tick = time.monotonic()

    def loop_stalled(self, now: float) -> bool:
        """True when the event loop did not run the watchdog for a while (reports may be unread)."""
        return now - self.last_tick > self._stall_limit

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            stalled = self.loop_stalled(now)
            self.last_tick = now
            for group in self.groups:
                if group.alive:
                    self._check(group, now, silence=not stalled)  # exits are judged right away
            await asyncio.sleep(self.period)

    def _check(self, group: WorkerGroup, now: float, *, silence: bool) -> None:
        try:
            reason = group.fault(now, silence=silence)
            if reason is not None:
                self._on_fault(group, reason)
        except Exception:  # keep watching the other groups; a dead watchdog would hide every fault
            log.exception("watchdog check of group %d failed", group.index)
