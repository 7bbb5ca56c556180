"""Vision towers: load only the vision weights of a checkpoint (or the demo tower) and encode packed batches."""

from vitserve.model.base import Encoder
from vitserve.model.loader import load_encoder

__all__ = ["Encoder", "load_encoder"]
