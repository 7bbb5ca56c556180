"""A parent process for test_faults_parent.py (docs/design.md invariant 16): starts an engine (tp=2, FakeEncoder), prints its worker pids, waits."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.fakes import FakeEncoderFactory
from tests.integration.engine_helpers import all_pids, make_config
from vitserve.engine import Engine
from vitserve.metrics import Metrics


async def main(tmp: str) -> None:
    engine = Engine(make_config(Path(tmp), tp=2), Metrics(), encoder_factory=FakeEncoderFactory(), environ={})
    await engine.start()
    print(json.dumps(all_pids(engine)), flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
