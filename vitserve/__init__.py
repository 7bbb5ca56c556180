"""vitserve: the vision encoder of multimodal LLMs as a sidecar service."""

__version__ = "0.1.0"
WIRE_VERSION = 1  # the LLM wire format (vitserve/rpc/wire.py, docs/integration.md)
