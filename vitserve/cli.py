"""The `vitserve` entry point: flags + VITSERVE_* environment -> one frozen Config -> Service.run().

The flags and the environment are read by vitserve/flags.py (`build_config`); VITSERVE_RUNTIME_DIR sets the
runtime directory. This module is the composition root: start-up checks (exit 2 and one line), the banner,
the stop handlers, and the Service (or, on a node other than 0, its ranks only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from vitserve import preflight
from vitserve.config import Config
from vitserve.errors import ConfigError, VitserveError
from vitserve.flags import build_config
from vitserve.metrics import Metrics

if TYPE_CHECKING:  # imported lazily below: the server pulls in uvicorn, torch and transformers
    from vitserve.api.server import Service

log = logging.getLogger("vitserve")


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def _resolved_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def render_banner(service: Service) -> str:
    """One block with every resolved setting that guards memory or load (docs/api.md)."""
    from vitserve.engine.cache import redacted_url

    c: Config = service.config
    info = service.engine.info()
    reserved = info.reserved_memory_bytes
    per_rank = ", ".join(f"rank {r}: {_mib(b)}" for r, b in sorted(reserved.items())) or "unknown"
    budget = f"{c.budget_tokens} tokens per batch and per image" if c.budget_enabled else "OFF (no clamp)"
    lines = [
        f"vitserve {__import__('vitserve').__version__} serving on http://{c.host}:{service.port}",
        f"  model: {info.model} (family {info.family}, dim {info.embed_dim}, "
        f"dtype {info.dtype}, device {_resolved_device(c.device)})",
        f"  budget: {budget}; at most {c.max_batch_images} images per batch",
        f"  processor clamp: {service.processor.clamp_info()}",
        f"  layout: tp={info.tp} dp={info.dp}",
        f"  reserved memory per rank: {per_rank} (source: {info.reserved_source})",
        f"  queue: max_queue_tokens={c.queue_token_limit or 'unlimited'}; request: "
        f"max_images_per_request={c.max_images_per_request}, max_request_bytes={c.max_request_bytes}, "
        f"max_image_pixels={c.max_image_pixels}, request_timeout_s={c.request_timeout_s}",
        f"  llm_endpoint: {c.llm_endpoint or 'none (inline only)'}; api_key: {'set' if c.api_key else 'none'}; "
        f"image URLs: {'on for ' + ','.join(c.allowed_url_domains) if c.allow_image_urls else 'off'}",
        f"  cache: {f'{c.cache_gb:g} GiB' if c.cache_gb > 0 else 'off'} (in-flight dedup always on); "
        f"shared: {redacted_url(c.cache_url) if c.cache_url else 'off'}; "
        f"jpeg_draft: {'on' if c.jpeg_draft else 'off'}",
        "  output: NOT exact: --jpeg_draft is on (docs/jpeg_draft.md)"
        if c.jpeg_draft
        else "  output: exact (matches transformers)",
    ]
    return "\n".join(lines)


def _build_service(config: Config) -> Service:
    from vitserve.api.server import Service, bind_socket, warmup_image
    from vitserve.processors import load_image_processor

    processor = load_image_processor(
        config.model, budget_tokens=config.budget_tokens, family=config.model_family
    )
    preflight.check_processor_budget(config.budget_tokens, processor.clamp_info())
    sock = bind_socket(config.host, config.port)
    from vitserve.engine import Engine  # heavy (zmq, workers): only once the cheap checks passed

    metrics = Metrics()
    engine = Engine(
        config,
        metrics,
        processor_clamp=processor.clamp_info(),  # the clamp keys the cache
        warmup_image=warmup_image(processor),
    )
    return Service(config, engine, processor, metrics, sock=sock, banner=render_banner)


def _exit_now(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT before the service's event loop takes the signals over: no rank exists yet and the
    listening socket closes with the process, so leave at once. Raising instead would unwind through
    whatever import is running, and libraries that catch broad exceptions around their imports then carry
    on (seen: start-up continuing after SIGTERM, numpy imported twice)."""
    os.write(2, f"vitserve: stopped by {signal.Signals(signum).name} during start-up\n".encode())
    os._exit(128 + signum)


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
        # Encoder ranks inherit this. With the default (spinning) policy their idle OpenMP threads burn the
        # cores the API's preprocessing threads need: small images at 4 clients went 1.9 -> 9.9 img/s with
        # PASSIVE on 2 cores (bench/history/0.1.0.md, Serving, run 3). A value the user set is kept.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        logging.basicConfig(
            level=config.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        preflight.check(config)  # settings that can never serve exit 2 before anything slow
        from vitserve.worker import zygote  # light: the forkserver imports the heavy modules, not us

        zygote.start(config.model)  # the ranks' imports run beside ours from here on
        if config.node_rank > 0:  # ranks only: no HTTP, no processor, no queue (docs/engine.md, Nodes)
            from vitserve.engine.node import run_node
        else:
            service = _build_service(config)
    except (ConfigError, VitserveError, OSError) as exc:
        print(f"vitserve: start-up failed: {exc}", file=sys.stderr)
        return 2
    if config.node_rank > 0:
        return run_node(config, os.environ)
    return asyncio.run(service.run())


if __name__ == "__main__":
    raise SystemExit(main())
