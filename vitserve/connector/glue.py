"""vitserve's own vLLM encoder-cache connector (docs/vllm.md, "vitserve's vLLM connector"; SPEC §12): vitserve
pushes each embedding over its wire (docs/wire.md) to this connector inside vLLM, then sends vLLM a chat request
whose parts name the embeddings by uuid only and whose `ec_transfer_params` announces them. Loaded by vLLM 0.32
by module path:

    --ec-transfer-config '{"ec_connector": "VitserveECConnector", "ec_connector_module_path":
      "vitserve.vllm_connector", "ec_role": "ec_consumer", "ec_connector_extra_config":
      {"endpoint": "tcp://10.0.0.5:5600", "max_gb": 4, "key_file": "/run/secrets/vitserve-wire-key"}}'

vLLM builds the class twice. The SCHEDULER side (in vLLM's engine-core process) runs the receiver
(vitserve/connector/store.py): it binds `endpoint`, checks and acknowledges each message, and keeps the tensor as a
file in /dev/shm. The WORKER side (in each worker: inside the engine-core process with one GPU, a process of
its own with several GPUs and on vLLM's CPU platform) copies a file into vLLM's encoder cache on its device in
start_load_caches; the scheduler side names the files in the step's metadata, and pins each one until the
request that loads it finishes, so the file is there.

Per request, in the scheduler (vLLM 0.32 vllm/v1/core/sched/scheduler.py calls, for one request at a time:
ensure_cache_available, then has_cache_item for its items, then update_state_after_alloc for the allocated ones):
- ensure_cache_available decides with admission.py's pure rules: an item is supplied from here only when the
  request announced it and the tensor held agrees with the announcement, the placeholder and the model's width.
  One announced and not here yet defers the request, for at most `wait_s`, and not at all once the receiver has
  failed (pull: the fetches start, and an engine with nothing else to run waits for them in place, at most
  pulling.IDLE_WAIT_S, rather than step empty); a malformed announcement, a mismatch, an item without pixels
  that is not announced, or a wait past `wait_s`: the request is named by take_unavailable_requests and vLLM
  fails it alone.
- has_cache_item says True only for a uuid that ensure_cache_available just checked for the request being
  scheduled; items with pixels that are not announced are vLLM's own to encode.
Nothing here raises into vLLM's scheduler: an error of the connector's own fails the request concerned.

Imports: torch, pyzmq, msgspec or msgpack (rpc/wire.py), the standard library, vitserve's rpc modules, and vLLM
itself; `pip install --no-deps vitserve` into vLLM's environment is all it needs (tests/integration/test_vllm_connector_imports.py
checks it in a fresh interpreter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.logger import init_logger

from vitserve.connector import admission, counters
from vitserve.connector.allowlist import DEFAULT_ACCEPT_FROM, DEFAULT_PULL_FROM
from vitserve.connector.config import KEY, ConnectorConfig, for_rank, parse_config, start_store
from vitserve.connector.pulling import EngineSteps, Puller
from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.rpc.tensors import DTYPES
from vitserve.rpc.wirekey import read_key_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = init_logger("vllm.vitserve_connector")  # under "vllm": vLLM's handler and VLLM_LOGGING_LEVEL apply

MODULE_PATH = "vitserve.vllm_connector"  # the ec_connector_module_path that names this module to vLLM
IDLE_STEP_WAIT_S = 0.01  # the longest an empty step waits for a running fetch (it ends the wait at once)


@dataclass
class VitserveECMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is not in vitserve's venv
    """The files the workers load this step: uuid -> {path, dtype, rows, width}."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)


class VitserveECConnector(ECConnectorBase):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self._dtype = vllm_config.model_config.dtype
        self.store: EmbeddingStore | None = None
        self._puller: Puller | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)

    def _init_scheduler(self, vllm_config: VllmConfig) -> None:
        config, unknown = parse_config(vllm_config.ec_transfer_config.ec_connector_extra_config or {})
        if unknown:
            log.warning("vitserve connector: ignoring %s.%s (not a key it knows)", KEY, ", ".join(unknown))
        self._wait_s = config.wait_s
        self._model_config = vllm_config.model_config
        self._metadata_fields: dict[str, frozenset[str]] = {}  # modality -> vLLM's placeholder metadata keys
        self._loads: dict[str, dict[str, Any]] = {}
        self._announced: dict[str, dict[str, admission.Announced]] = {}  # request id -> its announcement
        self._supplied: dict[str, set[str]] = {}  # request id -> uuids checked and pinned for it
        self._checking: frozenset[str] = frozenset()  # what has_cache_item may say True for (the request now)
        self._waiting_since: dict[str, float] = {}  # request id -> first deferral (monotonic)
        self._unavailable: set[str] = set()
        self._steps = EngineSteps()
        self._counts: dict[str, int] = {}  # the glue's own counters (counters.py)
        self._reported: dict[str, int] = {}  # the last counters sent to vLLM's stats
        parallel = vllm_config.parallel_config
        local = getattr(parallel, "data_parallel_rank_local", None)
        config = for_rank(config, parallel.data_parallel_index, local)  # ValueError: cannot serve
        dtype = str(self._dtype).removeprefix("torch.")
        self.store = start_store(config, _model_shape(vllm_config), log, dtype)
        key = read_key_file(config.key_file) if config.key_file else None
        self._puller = Puller(config, key, self.store, log)
        log.info(
            "vitserve connector: bound %s, pulls from %s (max_gb %g, key %s, wait_s %g, width %d, merge %d), "
            "files in %s",
            self.store.endpoint or "nothing (pull only)",
            ", ".join(config.pull_from or DEFAULT_PULL_FROM),
            config.max_gb,
            _keying(config),
            config.wait_s,
            self.store.shape.width,
            self.store.shape.merge,
            self.store.dir,
        )

    # ------------------------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._checking

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._checking = frozenset()
        if request.request_id in self._unavailable:
            return False
        try:
            admitted = self._ensure(request, num_computed_tokens)
        except Exception:  # the connector's own error fails this request, never vLLM's scheduler
            log.exception("vitserve connector: checking request %s failed", request.request_id)
            return self._fail(request, "error", "the connector failed to check it (see the traceback above)")
        if admitted:
            self._steps.has_work()
        return admitted

    def _ensure(self, request: Request, num_computed_tokens: int) -> bool:
        assert self.store is not None
        rid = request.request_id
        try:
            announced = self._announcement(request)
        except admission.AnnouncementError as exc:
            return self._fail(request, "malformed", f"its ec_transfer_params is malformed: {exc}")
        items = [self._item(request, index, num_computed_tokens) for index in range(len(request.mm_features))]
        verdict = admission.admit(items, announced, self.store.get, self.store.shape.width)
        if verdict.failure is not None:
            return self._fail(request, verdict.reason or "mismatch", verdict.failure)
        if verdict.missing:
            assert self._puller is not None
            why = self._puller.step(rid, verdict.missing, announced, self._left_s(rid))
            if why is not None:
                return self._fail(request, "pull", why)
            if self._steps.idle_but(rid):
                self._steps.has_work()  # one wait in place per step: a second request defers as before
                if self._puller.wait(verdict.missing, self._left_s(rid)):
                    self._count("pull_idle_waits")
                    return self._ensure(request, num_computed_tokens)  # checked again: all here, or defer
            return self._defer(request, verdict.missing)
        for uuid in verdict.supply - self._supplied.get(rid, set()):
            if self.store.pin(uuid, rid) is None:  # evicted since it was checked: wait for it as if missing
                return self._defer(request, (uuid,))
            self._supplied.setdefault(rid, set()).add(uuid)
        self._waiting_since.pop(rid, None)
        self._checking = verdict.supply
        return True

    def _announcement(self, request: Request) -> dict[str, admission.Announced]:
        rid = request.request_id
        if rid not in self._announced:
            self._announced[rid] = admission.parse_announcement(
                getattr(request, "ec_transfer_params", None), DTYPES
            )
        return self._announced[rid]

    def _item(self, request: Request, index: int, num_computed_tokens: int) -> admission.Item:
        feature = request.mm_features[index]
        position = feature.mm_position
        done = position.offset + position.length <= num_computed_tokens
        return admission.Item(
            uuid=feature.identifier,
            rows=0 if done else request.get_num_encoder_embeds(index),
            has_content=not done and self._has_content(feature),
            done=done,
        )

    def _has_content(self, feature: Any) -> bool:
        """Whether the item carries what vLLM's encoder needs: any processed key besides those vLLM's parser
        declares as placeholder metadata (`embedding_fields`; the grid, Qwen3-VL's timestamps). A raw image has
        pixel values, or with --mm-processor-cache-type shm an address; a metadata-only part has the grid only
        (vLLM passes embedding parts around its processor cache). As vLLM's own ECCPUConnector decides it."""
        if feature.data is None:
            return False
        metadata = self._metadata_fields.get(feature.modality)
        if metadata is None:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

            metadata = frozenset(PlaceholderMetadataResolver(self._model_config).fields_for(feature.modality))
            self._metadata_fields[feature.modality] = metadata
        return any(elem.data is not None for key, elem in feature.data.items() if key not in metadata)

    def _left_s(self, rid: str) -> float:
        """What is left of the request's wait_s (all of it before its first deferral)."""
        since = self._waiting_since.get(rid)
        return self._wait_s if since is None else self._wait_s - (time.monotonic() - since)

    def _defer(self, request: Request, missing: tuple[str, ...]) -> bool:
        assert self.store is not None
        now = time.monotonic()
        since = self._waiting_since.setdefault(request.request_id, now)
        failed = self.store.failure_since(since)
        why = admission.keep_waiting(missing, now - since, self._wait_s, failed)
        if why is None:
            return False
        return self._fail(request, "receiver_failed" if failed else "not_arrived", why)

    def _fail(self, request: Request, reason: str, why: str) -> bool:
        log.warning(
            "vitserve connector: request %s fails: %s (send it through vitserve --llm_transport wire, which "
            "pushes its embeddings to this connector, or pull, which announces where to fetch them)",
            request.request_id,
            why,
        )
        self._count("failed_" + reason)
        self._unavailable.add(request.request_id)
        self._checking = frozenset()
        return False

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        for rid in failed:
            self._release(rid)
        return failed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self.store is not None
        uuid = request.mm_features[index].identifier
        if uuid not in self._supplied.get(request.request_id, ()):
            return  # vLLM encodes it itself
        entry = self.store.get(uuid)  # pinned for this request since ensure_cache_available: still there
        if entry is not None:
            self._loads[uuid] = as_dict(entry)
            self._count("supplied")

    def build_connector_meta(self, scheduler_output: Any) -> VitserveECMetadata:
        meta, self._loads = VitserveECMetadata(self._loads), {}
        self._steps.stepped(
            getattr(scheduler_output, "num_scheduled_tokens", {}),
            getattr(scheduler_output, "finished_req_ids", ()),
        )
        if self._puller is not None and not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            # A step with nothing to run while requests wait for their fetches: vLLM's engine core has work, so it
            # would step again at once and spin a core (and this process's GIL) the fetch needs.
            self._puller.fetcher.wait_while_running(IDLE_STEP_WAIT_S)
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._steps.finished(request.request_id)
        self._release(request.request_id)
        return False, None

    def _release(self, rid: str) -> None:
        self._waiting_since.pop(rid, None)
        self._announced.pop(rid, None)
        if self._puller is not None:
            self._puller.forget(rid)
        if self.store is not None:
            self.store.unpin(self._supplied.pop(rid, set()), rid)

    def shutdown(self) -> None:
        if self._puller is not None:
            self._puller.close()
            self._puller = None
        if self.store is not None:
            self.store.close()
            self.store = None

    # ------------------------------------------------------------------------- metrics (vLLM's /metrics)

    def get_ec_connector_stats(self) -> Any:
        """What moved since the last step (vLLM calls it once per step on the scheduler side), or None."""
        if self.store is None:
            return None
        pulls = self._puller.counters() if self._puller is not None else {}
        now = counters.snapshot(self.store.counters(), {**self._counts, **pulls})
        data = counters.delta(self._reported, now)
        if not data:
            return None
        self._reported = now
        from vitserve.connector.metrics import VitserveECConnectorStats

        return VitserveECConnectorStats(data=data)

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from vitserve.connector.metrics import VitserveECConnectorStats

        return VitserveECConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from vitserve.connector.metrics import VitservePromMetrics

        return VitservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------------------------- worker side

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        """Copy this step's files into the encoder cache: local shared memory only, never the network."""
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for uuid, where in meta.loads.items():
            if uuid not in encoder_cache:
                # read_entry's tensor is a copy of its own (nothing of the file stays mapped): on a CPU in the
                # model's dtype `.to` is that tensor, one copy in all; on a GPU one more, host to device
                tensor = read_entry(where["path"], where["dtype"], where["rows"], where["width"])
                encoder_cache[uuid] = tensor.to(device=device, dtype=self._dtype)

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        return None  # a consumer only


def _keying(config: ConnectorConfig) -> str:
    if config.key_file is None:
        return "none"
    if config.wire_security == "tag":
        return f"required (wire_security tag: a tag per message, in clear, from {', '.join(config.accept_from or DEFAULT_ACCEPT_FROM)})"
    return "required"


def _model_shape(vllm_config: VllmConfig) -> Shape:
    """The width an embedding must have: the LLM's hidden size, times 1 + the DeepStack levels (Qwen3-VL,
    Qwen3.5); and the vision tower's spatial merge (rows = t*h*w / merge**2)."""
    hf_config = vllm_config.model_config.hf_config
    vision = getattr(hf_config, "vision_config", None)
    hidden = int(vllm_config.model_config.get_hidden_size())
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return Shape(width=hidden * (1 + levels), merge=int(getattr(vision, "spatial_merge_size", 2)))
