"""The groups' start-up as the engine sees it: waiting until every group is ready (or failed, or past the
start-up limit), and the Config the ranks' start-up decides.

`decided_config` is the one place where the budget the ranks chose for --visual_mem_gb (docs/engine.md, "A
budget from a memory target") becomes a Config: the engine's scheduler, and the Service's image processor
and app, are built from the Config it returns, after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from vitserve.config import Config
from vitserve.engine.groups import GroupState, WorkerGroup
from vitserve.errors import ConfigError, MemoryTargetError
from vitserve.worker.args import startup_timeout_s

log = logging.getLogger(__name__)


async def wait_ready(groups: list[WorkerGroup], config: Config) -> None:
    """Return once every group is READY; raise MemoryTargetError (--visual_mem_gb cannot be met, exit 2) or
    ConfigError (a group failed, or start-up passed --dist_timeout_s, at least 120 s)."""
    limit = startup_timeout_s(config)
    end = time.monotonic() + limit
    while not all(g.state is GroupState.READY for g in groups):
        failed = [g for g in groups if g.state is GroupState.FAILED]
        setting = next((g.setting_error for g in groups if g.setting_error), None)
        if setting is not None:  # --visual_mem_gb cannot be met: the rank's one line, exit 2
            raise MemoryTargetError(setting)
        if failed:
            raise ConfigError(
                f"encoder start-up failed: {failed[0].failure}{_startup_hint(failed[0].failure)}"
            )
        if time.monotonic() > end:
            raise ConfigError(
                f"encoder ranks did not finish start-up within {limit:g}s (--dist_timeout_s, at least 120 s)"
            )
        await asyncio.sleep(0.05)


def decided_config(config: Config, groups: list[WorkerGroup]) -> Config:
    """The Config to serve with, once every rank reported READY. --visual_mem_gb alone: the flags' Config
    with the budget the ranks chose (the smallest over the DP groups, each of which agreed on one over its
    TP ranks), as if --visual_batch_max_tokens had given it. Otherwise the flags' Config itself."""
    if config.budget_source != "visual_mem_gb":
        return config
    chosen = min(msg.budget_tokens for g in groups for msg in g.ready.values())
    log.info("--visual_mem_gb %g: the budget is %d tokens", config.visual_mem_gb, chosen)
    return dataclasses.replace(config, visual_batch_max_tokens=chosen)


def _startup_hint(failure: str | None) -> str:
    if not (failure and "out of memory" in failure.lower()):
        return ""
    return "; the worst-case reservation did not fit: lower --visual_batch_max_tokens, raise --tp, or set --visual_mem_gb"
