"""The `vitserve` entry point: flags + VITSERVE_* environment -> one frozen Config -> Service.run().

The flags and the environment are read by vitserve/flags/ (`build_config`); VITSERVE_RUNTIME_DIR sets the
runtime directory. This module is the composition root: start-up checks (exit 2 and one line), the banner,
the stop handlers, and the Service (or, on a node other than 0, its ranks only).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from vitserve import preflight
from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.errors import ConfigError, VitserveError
from vitserve.flags import build_config
from vitserve.metrics import Metrics

if TYPE_CHECKING:  # imported lazily below: the server pulls in uvicorn, torch and transformers
    from vitserve.api.server import Service
    from vitserve.processors import VisionProcessor
    from vitserve.worker.reservation import StressShape

log = logging.getLogger("vitserve")

OPENMP_SPIN = 3000  # GOMP_SPINCOUNT for the ranks' sleeping OpenMP threads: ~30 us of spin (openmp_defaults)


def render_banner(service: Service) -> str:
    """One block with every resolved setting that guards memory, load or exactness: the /v1/info body
    (vitserve/api/info.py), so the two always list the same settings."""
    from vitserve.api.info import banner, info_body

    assert service.processor is not None, "the banner is printed once the Service serves its app"
    info = info_body(service.config, service.engine, service.processor)
    return banner(info, f"http://{service.config.host}:{service.port}")


def _load_processor(config: Config, checkpoint: Checkpoint) -> VisionProcessor:
    from vitserve.processors import load_image_processor

    processor = load_image_processor(
        checkpoint, budget_tokens=config.visual_batch_max_tokens, resize=config.image_resize
    )
    preflight.check_processor_budget(config.visual_batch_max_tokens, processor.clamp_info())
    return processor


def _stress_shape(config: Config, processor: VisionProcessor) -> StressShape:
    """The worst case every rank reserves for, built here once: the ranks load no processor."""
    from vitserve.worker.reservation import StressShape

    return StressShape.of(config, processor.clamp_info())


def build_service(config: Config, checkpoint: Checkpoint) -> Service:
    """Node 0's service for a config preflight.check passed: the socket, the processor for the flags (its
    per-image limits bound the ranks' worst case; it preprocesses the warm-up image), the engine (its ranks
    start when the service runs), and the Service, which serves with that processor, or with --visual_mem_gb
    alone builds one at the budget the ranks chose (_processor_for). main runs it; tests run it in a thread
    (tests/e2e/live.py cli_in_process)."""
    from vitserve.api.listen import bind_socket

    sock = bind_socket(config.host, config.port)  # before the API's imports (~7 s): a busy port fails at once
    from vitserve.api.server import Service, warmup_image

    processor = _load_processor(config, checkpoint)
    from vitserve.engine import Engine  # heavy (zmq, workers): only once the cheap checks passed

    metrics = Metrics()
    engine = Engine(
        config,
        metrics,
        checkpoint=checkpoint,
        warmup_image=warmup_image(processor),
        stress_shape=_stress_shape(config, processor),
    )
    return Service(
        config,
        engine,
        functools.partial(_processor_for, checkpoint, config, processor),
        metrics,
        sock=sock,
        banner=render_banner,
    )


def _processor_for(
    checkpoint: Checkpoint, flags: Config, loaded: VisionProcessor, config: Config
) -> VisionProcessor:
    """The processor the Service serves with, for the Config the engine's start decided: the one loaded for
    the flags when that is the flags' Config, else (--visual_mem_gb alone) one at the ranks' budget."""
    return loaded if config is flags else _load_processor(config, checkpoint)


def _exit_now(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT before the service's event loop takes the signals over: no rank exists yet and the
    listening socket closes with the process, so leave at once. Raising instead would unwind through
    whatever import is running, and libraries that catch broad exceptions around their imports then carry
    on (seen: start-up continuing after SIGTERM, numpy imported twice)."""
    os.write(2, f"vitserve: stopped by {signal.Signals(signum).name} during start-up\n".encode())
    os._exit(128 + signum)


def openmp_defaults(environ: MutableMapping[str, str]) -> None:
    """The encoder ranks' OpenMP wait, set before they start (they inherit it); a value the user set is kept.

    libgomp's default spins ~3 ms after every parallel region: idle threads then burn the cores the API's
    preprocessing needs. Sleeping at once (PASSIVE alone) costs a futex wake per parallel region, hundreds per
    forward: ~10% of a one-image forward. So the threads sleep, but only after a spin of GOMP_SPINCOUNT
    iterations (~30 us, libgomp's estimate is 100,000 per ms), which covers the gaps inside one forward and
    ends soon after it (bench/RESULTS.md, "Measurements behind the code"). GOMP_SPINCOUNT is set only
    beside the PASSIVE this sets: with a policy the user chose, libgomp's own spin for it stays.
    """
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN))


def install_stop_handlers() -> None:
    """First thing in main: a stop request ends start-up at any moment (imports, reading the checkpoint),
    not only once the event loop runs; as PID 1 in a container a signal without a handler is ignored."""
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_now)


def main(argv: list[str] | None = None) -> int:
    """Exit codes (docs/api.md): 0 stopped after serving; 1 start-up failed in the ranks or no encoder group
    is left (on a node > 0: node 0 went away); 2 a setting that can never work; 128 + N stopped by signal N
    before serving (130, 143)."""
    install_stop_handlers()
    try:
        config = build_config(argv, os.environ)
        openmp_defaults(os.environ)
        logging.basicConfig(
            level=config.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        checkpoint = preflight.check(config)  # settings that can never serve exit 2 before anything slow
        from vitserve.processes import zygote  # light: the forkserver imports the heavy modules, not us

        zygote.start(checkpoint)  # the ranks' imports run beside ours from here on
        if config.node_rank > 0:  # ranks only: no HTTP, no queue (docs/engine.md, Nodes)
            from vitserve.engine.node import run_node

            shape = _stress_shape(
                config, _load_processor(config, checkpoint)
            )  # the same worst case as node 0's ranks
        else:
            service = build_service(config, checkpoint)
    except (ConfigError, VitserveError, OSError) as exc:
        print(f"vitserve: start-up failed: {exc}", file=sys.stderr)
        return 2
    if config.node_rank > 0:
        return run_node(config, checkpoint, os.environ, shape)
    return asyncio.run(service.run())


if __name__ == "__main__":
    raise SystemExit(main())
