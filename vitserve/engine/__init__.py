"""The API process's side of encoding: implements contract.Engine over spawned encoder groups."""

from vitserve.engine.engine import Engine

__all__ = ["Engine"]
