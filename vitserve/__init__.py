"""vitserve: the vision encoder of multimodal LLMs as a sidecar service.

    from vitserve import VitserveClient, AsyncVitserveClient, EmbeddingReceiver

Those names load on first use (PEP 562): `import vitserve` alone stays cheap (no torch, zmq or
transformers), which the CLI's `--version`/`--help` and tools that only read `__version__` rely on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vitserve.lazy import lazy_names

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vitserve.client import AsyncVitserveClient, VitserveClient, VitserveClientError
    from vitserve.rpc.receiver import EmbeddingReceiver
    from vitserve.rpc.wire import WIRE_VERSION

# public name -> module that defines it
_LAZY = {
    "WIRE_VERSION": "vitserve.rpc.wire",
    "VitserveClient": "vitserve.client",
    "AsyncVitserveClient": "vitserve.client",
    "VitserveClientError": "vitserve.client",
    "EmbeddingReceiver": "vitserve.rpc.receiver",
}

__all__ = [
    "WIRE_VERSION",
    "AsyncVitserveClient",
    "EmbeddingReceiver",
    "VitserveClient",
    "VitserveClientError",
    "__version__",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
