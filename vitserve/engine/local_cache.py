"""The encoder-output cache (--cache_gb): never encode the same image twice.

An LRU of EncodedImage (embedding + deepstack, CPU tensors) bounded in BYTES: the sum of the held
tensors' nbytes never exceeds `max_bytes`; an entry larger than the whole cache is not stored.

Keys are `cache_key(fingerprint, image_id)`: the image bytes' sha256 (`image_id` in docs/api.md) plus a
fingerprint of everything that changes the encoder's output for the same bytes (the weights' content digest,
which covers the checkpoint's configs, the family, the budget, dtype, device type, --image_resize,
--jpeg_draft, wire and software versions). The fingerprint is computed once at start-up by
`cache_fingerprint`, so a cache can never hand out an embedding made under another configuration.

Threading: the engine calls the cache only from its asyncio event loop (one thread) and no method
awaits, so no lock is needed. Do not share one EmbeddingCache between threads.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from importlib.metadata import version as _version

import torch

import vitserve
from vitserve.config import GIB, Config
from vitserve.contract import EncodedImage
from vitserve.metrics import Metrics
from vitserve.rpc.wire import WIRE_VERSION

FINGERPRINT_VERSION = 3  # bump when the meaning of an entry changes (e.g. a new field in EncodedImage)
LOCAL = "local"  # the `layer` label of this cache's metrics (the shared layer: engine/shared_cache.py)


def cache_fingerprint(
    config: Config,
    *,
    weights: str,
    model_name: str | None,
    family: str | None,
    dtype: str | None,
    device: str | None,
) -> str:
    """A stable hex digest of everything besides the image bytes that decides the encoder's output.

    weights: the content digest of the checkpoint rank 0 loaded (vitserve/checkpoint.py WeightsDigest): the
    vision tensors and the checkpoint's configs, so also the image processor's parameters; with the budget,
    the family, --image_resize and vitserve's version they pin every pixel the processor makes. It names the
    same weights on every host, whatever the path, so replicas can share entries (--cache_url). device:
    "cpu", "cuda:1", ...; only its type counts (two GPUs of one kind give the same embedding). The software
    versions are in too: another vitserve, torch or transformers may preprocess or round differently, and an
    entry stays exact to its producer.
    """
    doc = {
        "v": FINGERPRINT_VERSION,
        "weights": weights,
        "model_family_flag": config.model_family,
        "model_name": model_name,
        "family": family,
        "budget": config.visual_batch_max_tokens,
        "image_resize": config.image_resize,  # torch and pil resize to different pixels
        "dtype": dtype,
        "device_type": (device or config.device).split(":")[0],
        "tp": config.tp,  # a TP sum differs from TP1 by round-off; keep entries exact to their producer
        "jpeg_draft": config.jpeg_draft,  # reduced-scale JPEG decoding changes the pixels
        "wire_format": WIRE_VERSION,
        "versions": [vitserve.__version__, torch.__version__, _version("transformers")],
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def cache_key(fingerprint: str, image_id: str) -> str:
    return f"{fingerprint}:{image_id}"


def cache_bytes_from_gb(cache_gb: float) -> int:
    """--cache_gb as bytes; 0 (or less) disables the cache."""
    return max(0, int(cache_gb * GIB))


def entry_nbytes(encoded: EncodedImage) -> int:
    """Bytes an entry holds: its tensors' storage (each tensor is its own buffer, see rpc/tensors.py)."""
    return sum(t.numel() * t.element_size() for t in (encoded.embedding, *encoded.deepstack))


class EmbeddingCache:
    """LRU over EncodedImage, bounded in bytes. get() moves a hit to the most-recent end."""

    def __init__(self, max_bytes: int, metrics: Metrics):
        if max_bytes <= 0:
            raise ValueError("an EmbeddingCache needs max_bytes > 0 (--cache_gb 0 means: build none)")
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._entries: OrderedDict[str, tuple[EncodedImage, int]] = OrderedDict()  # key -> (value, nbytes)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries  # no LRU touch, no counters

    def get(self, key: str) -> EncodedImage | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            self.metrics.cache_misses_total.labels(layer=LOCAL).inc()
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        self.metrics.cache_hits_total.labels(layer=LOCAL).inc()
        self.metrics.cache_read_bytes_total.labels(layer=LOCAL).inc(entry[1])
        return entry[0]

    def put(self, key: str, encoded: EncodedImage) -> bool:
        """Store (or refresh) an entry; False when it is larger than the whole cache and was not stored."""
        size = entry_nbytes(encoded)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self._entries and self.bytes + size > self.max_bytes:
            self._evict_oldest()
        self._entries[key] = (_detached(encoded), size)
        self.bytes += size
        self.metrics.cache_bytes.labels(layer=LOCAL).set(self.bytes)
        self.metrics.cache_written_bytes_total.labels(layer=LOCAL).inc(size)
        return True

    def _evict_oldest(self) -> None:
        _, (_, size) = self._entries.popitem(last=False)
        self.bytes -= size
        self.evictions += 1
        self.metrics.cache_evictions_total.labels(layer=LOCAL).inc()


def _detached(encoded: EncodedImage) -> EncodedImage:
    """The entry as stored: CPU, contiguous, no autograd history (no copy when it already is)."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    return EncodedImage(embedding=fix(encoded.embedding), deepstack=[fix(t) for t in encoded.deepstack])


def make_cache(config: Config, metrics: Metrics) -> EmbeddingCache | None:
    """The configured cache, or None with --cache_gb 0 (no object, no per-request overhead)."""
    max_bytes = cache_bytes_from_gb(config.cache_gb)
    return EmbeddingCache(max_bytes, metrics) if max_bytes else None
