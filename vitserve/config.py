"""One frozen config object, built at the entry point (cli.py) and passed down.

Nothing below the entry point reads environment variables; every field mirrors a flag (docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vitserve.checkpoint import DEMO

MIB = 1024 * 1024
GIB = 1024 * MIB
TORCHRUN_MASTER_PORT = 29500  # torchrun's default --master_port, ours with --nnodes > 1


@dataclass(frozen=True)
class Config:
    model: str = DEMO  # a checkpoint directory, or the demo (vitserve/checkpoint.py)
    model_family: str = "auto"  # qwen2_vl | qwen2_5_vl | qwen3_vl | qwen3_5 | internvl | auto
    tp: int = 1
    dp: int = 1
    visual_batch_max_tokens: int = 8192  # per-step batch budget AND per-image cap; 0 disables both
    visual_infer_batch_size: int = 64
    # merged tokens one video may cost in all: its frames shrink to fit (docs/processing.md "Video"); 0 = no cap
    max_video_tokens: int = 16384
    host: str = "127.0.0.1"
    port: int = 8100
    llm_endpoint: str | None = None
    # the OpenAI-compatible front door (docs/vllm.md): the LLM server's base URL, its key, the completion deadline
    llm_url: str | None = None
    llm_api_key: str | None = field(default=None, repr=False)  # never logged, never in the banner
    llm_timeout_s: float = 600.0
    # how the front door hands embeddings over (docs/vllm.md): "inline" in the JSON body, or "ec_storage": as
    # vLLM's encoder-cache producer, files under ec_storage_path (the consumer's shared_storage_path), an unused
    # file kept ec_ttl_s at most, the directory bounded to ec_storage_gb (least recently used first)
    llm_transport: str = "inline"  # or "wire": pushed to vitserve's vLLM connector at llm_endpoint
    wire_key_file: str | None = None  # the connector's shared secret (wire only); its path, never its bytes
    # how that secret keys the wire: None or "curve" (ZMQ CURVE: authenticated, encrypted), "tag" (a tag per
    # message, the bytes in clear: vitserve/rpc/tag.py), as the connector's wire_security
    wire_security: str | None = None  # one of vitserve/endpoints.py WIRE_SECURITIES
    # wire to a vLLM with --data-parallel-size N: its engine cores' connectors, at --llm_endpoint + rank; None = 1
    llm_dp_size: int | None = None
    ec_storage_path: str | None = None
    # --llm_transport pull (docs/vllm.md, "Pull"): where vitserve's producer binds, the endpoint vLLM fetches from,
    # and the bound on what it keeps for fetching
    pull_bind: str | None = None
    pull_advertise: str | None = None
    pull_store_gb: float = 4.0
    ec_ttl_s: float = 600.0
    ec_storage_gb: float = 4.0
    max_queue_tokens: int | None = None  # None -> 4 x budget (see queue_token_limit)
    max_images_per_request: int = 32
    max_request_bytes: int = 64 * MIB
    max_image_pixels: int = 50_000_000
    # video limits, checked from the container header (and the demuxed frame count) before decoding
    max_video_bytes: int = 256 * MIB
    max_video_duration_s: float = 3600.0
    max_video_frames: int = 36_000  # frames in the video (counted by demuxing)
    video_decoders: int = 2  # decoder processes: videos decoded at a time (docs/video.md); 0 = no videos
    request_timeout_s: float = 120.0
    heartbeat_s: float = 60.0
    dist_timeout_s: float = 1800.0
    device: str = "auto"
    dtype: str = "auto"
    visual_reserved_mem_gb: float | None = None
    # --visual_mem_gb (docs/engine.md, "A budget from a memory target"): each rank's worst case must fit in this
    # many GiB. budget_source is no flag: "flag" when --visual_batch_max_tokens sets the budget (with
    # --visual_mem_gb too, it is checked against it), "visual_mem_gb" when the ranks choose it; until they
    # have, visual_batch_max_tokens is 0; the Config to serve with, holding their choice, is built once
    # (engine/startup.py decided_config), before the scheduler, the image processor and the app.
    visual_mem_gb: float | None = None
    budget_source: str = "flag"
    api_key: str | None = None
    allow_image_urls: bool = False
    allowed_url_domains: tuple[str, ...] = field(default_factory=tuple)
    cache_gb: float = 0.0
    # the shared cache layer (docs/cache.md): redis:// or rediss:// URL, may hold a password (never shown)
    cache_url: str | None = field(default=None, repr=False)
    cache_ttl_s: float = 0.0  # TTL of shared-cache entries; 0 = none (Redis's maxmemory policy evicts)
    # decode a JPEG at 1/2..1/8 scale when the budget clamp shrinks it at least 2x (docs/jpeg_draft.md);
    # off by default: faster, but the embeddings no longer match transformers' (not exact)
    jpeg_draft: bool = False
    # capture the tower in CUDA graphs per token bucket after the reservation (vitserve/worker/graphs.py)
    cuda_graphs: bool = False
    # whose pixels: auto = torch = transformers' torchvision ("fast") processor, as vLLM and SGLang use; pil
    image_resize: str = "auto"
    log_level: str = "info"
    otlp_endpoint: str | None = None  # OTLP/HTTP collector for /encode spans; None = tracing off
    runtime_dir: str = "/dev/shm/vitserve"  # VITSERVE_RUNTIME_DIR (docs/engine.md)
    # TP across nodes, torchrun's meanings (docs/engine.md, "Nodes"): --tp ranks in all, --tp / --nnodes on
    # each node; node 0 runs HTTP, the queue and rank 0, the other nodes run ranks only.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's torch.distributed store; None (one node) -> a private FileStore
    master_port: int | None = None  # None -> TORCHRUN_MASTER_PORT with --nnodes > 1, a free port on one node

    @property
    def node_ranks(self) -> range:
        """The TP ranks of each group that this node runs: --tp / --nnodes consecutive ranks (node 0 has
        rank 0). On one node, every rank."""
        per_node = self.tp // max(1, self.nnodes)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def global_rank(self, group: int, rank: int) -> int:
        """Rank `rank` of DP group `group` numbered across every group (reservation files, metrics labels)."""
        return group * self.tp + rank

    @property
    def budget_enabled(self) -> bool:
        return self.visual_batch_max_tokens > 0

    @property
    def queue_token_limit(self) -> int | None:
        """Queued tokens above which new requests get 503; None when unlimited (budget off, no flag)."""
        if self.max_queue_tokens is not None:
            return self.max_queue_tokens
        return 4 * self.visual_batch_max_tokens if self.budget_enabled else None


def redacted_url(url: str) -> str:
    """A URL flag's value (--llm_url, --cache_url) without user or password, for messages, logs and /v1/info."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"
