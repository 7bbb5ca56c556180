"""Prometheus metrics (docs/api.md), all prefixed `vitserve_`, on a registry of their own.

One `Metrics` object per server; components receive it instead of touching globals, so tests can make
fresh ones and read values back with `Metrics.value(name, **labels)`.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.85, 0.9, 0.95, 1.0)
_BYTES_BUCKETS = (1024, 4096, 16384, 65536, 262144, 2**20, 2**22, 2**24, 2**26, 2**28)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series only add noise to scrapes


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "vitserve_"
        self.requests_total = Counter(
            p + "requests", "HTTP requests by status code, probes excepted", ["code"], registry=r
        )
        self.probes_total = Counter(
            p + "probes",
            "Probe requests (/health, /ready, /metrics) by path and code",
            ["path", "code"],
            registry=r,
        )
        # The names say "images"; what each counts (docs/api.md, /metrics): encoded, cached, the queue and
        # batch gauges count items (an image, or a video's temporal group); rejected, image_tokens and
        # images_clamped count images only.
        self.images_total = Counter(p + "images", "Images by outcome", ["outcome"], registry=r)
        self.images_clamped_total = Counter(p + "images_clamped", "Images shrunk by the budget", registry=r)
        self.image_tokens = Histogram(
            p + "image_tokens", "Tokens per image", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.queue_tokens = Gauge(p + "queue_tokens", "Tokens waiting in the queue", registry=r)
        self.queue_images = Gauge(p + "queue_images", "Images waiting in the queue", registry=r)
        self.batch_tokens = Histogram(
            p + "batch_tokens", "Tokens per batch", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_images = Histogram(
            p + "batch_images", "Images per batch", buckets=_COUNT_BUCKETS, registry=r
        )
        self.batch_fill_ratio = Histogram(
            p + "batch_fill_ratio", "Batch tokens / budget", buckets=_FILL_BUCKETS, registry=r
        )
        self.stage_seconds = Histogram(
            p + "stage_seconds", "Time per stage", ["stage"], buckets=_SECONDS_BUCKETS, registry=r
        )
        self.embedding_bytes_sent_total = Counter(
            p + "embedding_bytes_sent", "Embedding bytes pushed to the LLM endpoint", registry=r
        )
        self.llm_messages_total = Counter(
            p + "llm_messages",
            "Embedding messages to the LLM endpoint by outcome: delivered (acknowledged), llm_timeout, "
            "llm_refused (a nack), not_ready (shut down first), withdrawn (the client went away first), "
            "llm_connector_unavailable (wire: no connector to send to)",
            ["outcome"],
            registry=r,
        )
        self.reserved_memory_bytes = Gauge(
            p + "reserved_memory_bytes", "Reserved activation memory per rank", ["rank"], registry=r
        )
        self.workers_ready = Gauge(p + "workers_ready", "Encoder ranks that are ready", registry=r)
        self.heartbeats_total = Counter(p + "heartbeats", "Heartbeats broadcast by rank 0", registry=r)
        # Encoder-output cache, by layer: "local" (--cache_gb, this process) and "shared" (--cache_url, Redis).
        self.cache_hits_total = Counter(
            p + "cache_hits", "Encoder-output cache hits by layer", ["layer"], registry=r
        )
        self.cache_misses_total = Counter(
            p + "cache_misses", "Encoder-output cache misses by layer", ["layer"], registry=r
        )
        self.cache_errors_total = Counter(
            p + "cache_errors",
            "Shared-cache operations that failed, by layer and kind: unavailable (connection refused or "
            "lost), timeout, full (the server refused a write: maxmemory), corrupt (a value that failed its "
            "checksum; deleted), other",
            ["layer", "kind"],
            registry=r,
        )
        self.cache_read_bytes_total = Counter(
            p + "cache_read_bytes", "Entry bytes served from the cache by layer", ["layer"], registry=r
        )
        self.cache_written_bytes_total = Counter(
            p + "cache_written_bytes", "Entry bytes stored in the cache by layer", ["layer"], registry=r
        )
        self.cache_evictions_total = Counter(
            p + "cache_evictions", "Encoder-output cache evictions by layer", ["layer"], registry=r
        )
        self.cache_bytes = Gauge(
            p + "cache_bytes", "Bytes held by the encoder-output cache by layer", ["layer"], registry=r
        )
        self.cache_leases_total = Counter(
            p + "cache_leases",
            "Cross-replica dedup of new images by outcome: taken (this replica encodes), joined (another "
            "replica's encode was used), expired (waited the lease time, then encoded)",
            ["outcome"],
            registry=r,
        )

        # The front door (--llm_url): calls to the LLM server and their latency.
        self.upstream_requests_total = Counter(
            p + "upstream_requests",
            "Calls to the LLM server behind the front door (--llm_url) by route and code: its HTTP status, "
            "or llm_unavailable / llm_timeout when it gave none",
            ["route", "code"],
            registry=r,
        )
        self.upstream_seconds = Histogram(
            p + "upstream_seconds",
            "Latency of calls to the LLM server by phase: first_byte (its response headers), total (its "
            "last byte)",
            ["phase"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.upstream_body_bytes = Histogram(
            p + "upstream_body_bytes",
            "Bytes of each chat completion body sent to the LLM server",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        # The encoder-cache hand-over (--llm_transport ec_storage): the files under --ec_storage_path.
        self.ec_files = Gauge(p + "ec_files", "Encoder-cache files vitserve holds", registry=r)
        self.ec_bytes = Gauge(p + "ec_bytes", "Bytes of the encoder-cache files vitserve holds", registry=r)
        self.ec_writes_total = Counter(p + "ec_writes", "Encoder-cache files written", registry=r)
        self.ec_reuses_total = Counter(
            p + "ec_reuses",
            "Encoder-cache files named again instead of written (their image not encoded)",
            registry=r,
        )
        self.ec_evictions_total = Counter(
            p + "ec_evictions",
            "Encoder-cache files removed by reason: ttl (--ec_ttl_s), bytes (--ec_storage_gb), vanished "
            "(removed by someone else)",
            ["reason"],
            registry=r,
        )
        self.ec_swept_dirs_total = Counter(
            p + "ec_swept_dirs", "Empty directories vLLM's lookups left, removed", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float | None:
        """The current value of one sample, e.g. value("vitserve_requests_total", code="200")."""
        return self.registry.get_sample_value(name, labels)
