"""vitserve's own vLLM encoder-cache connector (docs/vllm.md, "vitserve's vLLM connector"; SPEC §12): vitserve
pushes each embedding over its wire (docs/wire.md) to this connector inside vLLM, then sends vLLM a chat request
whose parts name the embeddings by uuid only. Loaded by vLLM 0.32 by module path:

    --ec-transfer-config '{"ec_connector": "VitserveECConnector", "ec_connector_module_path":
      "vitserve.vllm_connector", "ec_role": "ec_consumer", "ec_connector_extra_config":
      {"endpoint": "tcp://0.0.0.0:5600", "max_gb": 4, "key_file": "/run/secrets/vitserve-wire-key"}}'

vLLM builds the class twice. The SCHEDULER side (in vLLM's engine-core process) runs the receiver
(vitserve/connector/store.py): it binds `endpoint`, checks and acknowledges each message, and keeps the tensor as a
file in /dev/shm. The WORKER side (in each worker: inside the engine-core process with one GPU, a process of
its own with several GPUs and on vLLM's CPU platform) copies a file into vLLM's encoder cache on its device in
start_load_caches; the scheduler side names the files in the step's metadata, and pins each one until the
request that loads it finishes, so the file is there.

A request's metadata-only items (an embedding part with no tensor) are checked before vLLM schedules it:
- ensure_cache_available: every such item whole and of the rows vLLM's placeholder needs and the model's width:
  True. One not here yet: False (vLLM defers the request) for at most `wait_s` (extra config, default 5 s).
- past that, or an item of the wrong rows or width: the request is named by take_unavailable_requests, and
  vLLM fails it (an error answer; the engine and the next request are unaffected).
- has_cache_item says True only for a tensor that is whole on this host. Items with pixels (a raw image) are
  vLLM's own to encode: this connector never defers them.

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

from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.rpc.wirekey import read_key_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = init_logger("vllm.vitserve_connector")  # under "vllm": vLLM's handler and VLLM_LOGGING_LEVEL apply

MODULE_PATH = "vitserve.vllm_connector"  # the ec_connector_module_path that names this module to vLLM
DEFAULT_WAIT_S = 5.0
# keys of an item's processed data that carry its content: an item with none of them is metadata-only
_CONTENT_MARKS = ("pixel_values", "_embeds", "input_features")


@dataclass
class VitserveECMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is not in vitserve's venv
    """The files the workers load this step: uuid -> {path, dtype, rows, width}."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)


class VitserveECConnector(ECConnectorBase):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        self._dtype = vllm_config.model_config.dtype
        self._loads: dict[str, dict[str, Any]] = {}
        self._pinned: dict[str, set[str]] = {}  # request id -> uuids pinned for it
        self._waiting_since: dict[str, float] = {}  # request id -> first deferral (monotonic)
        self._unavailable: set[str] = set()
        self._wait_s = float(config.get_from_extra_config("wait_s", DEFAULT_WAIT_S))
        self.store: EmbeddingStore | None = None
        if role == ECConnectorRole.SCHEDULER:
            self.store = _start_store(vllm_config)

    # ------------------------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return self.store is not None and self.store.touch(identifier) is not None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self.store is not None
        rid = request.request_id
        if rid in self._unavailable:
            return False
        missing = []
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if not _metadata_only(feature) or position.offset + position.length <= num_computed_tokens:
                continue  # vLLM encodes it itself, or its tokens are in the KV cache already
            entry = self.store.pin(feature.identifier, rid)
            if entry is None:
                missing.append(feature.identifier)
                continue
            self._pinned.setdefault(rid, set()).add(feature.identifier)
            rows = request.get_num_encoder_embeds(index)
            if entry.rows != rows or (self.store.shape.width and entry.width != self.store.shape.width):
                why = (
                    f"holds {entry.rows} x {entry.width}, the request needs {rows} x {self.store.shape.width}"
                )
                return self._fail(request, feature.identifier, why)
        if not missing:
            self._waiting_since.pop(rid, None)
            return True
        since = self._waiting_since.setdefault(rid, time.monotonic())
        if time.monotonic() - since >= self._wait_s:
            return self._fail(request, missing[0], f"never arrived (waited {self._wait_s:g} s)")
        return False

    def _fail(self, request: Request, uuid: str, why: str) -> bool:
        log.warning(
            "vitserve connector: request %s fails: its embedding %s %s (send it with vitserve "
            "--llm_transport wire to this connector first)",
            request.request_id,
            uuid,
            why,
        )
        self._unavailable.add(request.request_id)
        return False

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        for rid in failed:
            self._release(rid)
        return failed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self.store is not None
        uuid = request.mm_features[index].identifier
        entry = self.store.pin(uuid, request.request_id)
        if entry is not None:
            self._pinned.setdefault(request.request_id, set()).add(uuid)
            self._loads[uuid] = as_dict(entry)

    def build_connector_meta(self, scheduler_output: Any) -> VitserveECMetadata:
        meta, self._loads = VitserveECMetadata(self._loads), {}
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._release(request.request_id)
        return False, None

    def _release(self, rid: str) -> None:
        self._waiting_since.pop(rid, None)
        if self.store is not None:
            self.store.unpin(self._pinned.pop(rid, set()), rid)

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

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
                tensor = read_entry(where["path"], where["dtype"], where["rows"], where["width"])
                encoder_cache[uuid] = tensor.to(device=device, dtype=self._dtype)

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        return None  # a consumer only


def _metadata_only(feature: Any) -> bool:
    """An item whose processed data carries no content (no pixels, no embedding): its tensor comes from here."""
    data = feature.data
    return data is not None and not any(mark in key for key in data for mark in _CONTENT_MARKS)


def _start_store(vllm_config: VllmConfig) -> EmbeddingStore:
    config = vllm_config.ec_transfer_config
    endpoint = config.get_from_extra_config("endpoint", None)
    if not endpoint:
        raise ValueError(
            "VitserveECConnector needs ec_connector_extra_config.endpoint, e.g. tcp://0.0.0.0:5600"
        )
    max_gb = float(config.get_from_extra_config("max_gb", 4))
    key_file = config.get_from_extra_config("key_file", None)
    key = read_key_file(key_file) if key_file else None
    store = EmbeddingStore(
        endpoint,
        int(max_gb * 2**30),
        _model_shape(vllm_config),
        key=key,
        directory=config.get_from_extra_config("shm_dir", None),
        log=log,
    )
    log.info(
        "vitserve connector: bound %s (max_gb %g, key %s, width %d, merge %d), files in %s",
        store.endpoint,
        max_gb,
        "required" if key else "none",
        store.shape.width,
        store.shape.merge,
        store.dir,
    )
    return store


def _model_shape(vllm_config: VllmConfig) -> Shape:
    """The width an embedding must have: the LLM's hidden size, times 1 + the DeepStack levels (Qwen3-VL,
    Qwen3.5); and the vision tower's spatial merge (rows = t*h*w / merge**2)."""
    hf_config = vllm_config.model_config.hf_config
    vision = getattr(hf_config, "vision_config", None)
    hidden = int(vllm_config.model_config.get_hidden_size())
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return Shape(width=hidden * (1 + levels), merge=int(getattr(vision, "spatial_merge_size", 2)))
