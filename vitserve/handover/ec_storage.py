"""The front door's encoder-cache hand-over (--llm_transport ec_storage, docs/vllm.md): each image and video of
a chat request becomes a file under --ec_storage_path (handover/ec_store.py) and a metadata-only part that
names it by uuid; vLLM, started as an EC consumer of that directory, loads the file instead of a tensor in the
body.

- An image's uuid comes from its bytes and the engine's fingerprint (handover/ec_files.py `ec_uuid`), so it is
  known before the image is decoded: an image whose file is still there is neither decoded, nor encoded, nor
  written again (`EcTicket.held`). A video's uuid comes from its groups' ids (its bytes and sampling); a video
  is encoded through the engine (whose cache may hold its groups) and its file written only if missing.
- Parts sent: `{"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": U}`; a video's
  `video_embeds` with `video_grid_thw` (and Qwen3-VL / Qwen3.5's `timestamps`, as inline).
- vLLM hashes a uuid together with a request's `mm_processor_kwargs` and `media_io_kwargs` (and with its own
  server-level `--media-io-kwargs` for that modality) and would then look for a file that is not there, which
  kills its engine: both fields are removed from the request (`strip`); the consumer must not be started with
  --media-io-kwargs for a modality vitserve sends.
- Just before the request goes upstream every file it names is checked by its header (`EcTicket.ready`); the
  files stay pinned until the answer is complete (`EcTicket.release`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vitserve.config import GIB
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.errors import VitserveError
from vitserve.handover.base import Handover, Setup, Transport
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.ec_store import EcStore
from vitserve.handover.embeds import check_tensor, checked_video_tensor, llm_tensor, video_timestamps
from vitserve.transport_specs import EcStorageSpec

# What a vLLM that is not an EC consumer answers a metadata-only part with (400).
_NOT_CONSUMER = b"The data should contain the fields"
# The request fields vLLM hashes a uuid with (vllm/multimodal/processing/inputs.py get_mm_hashes).
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


class NotAConsumer(VitserveError):
    """The LLM server refused a metadata-only embedding part: it was not started as an EC consumer."""

    status, code = 502, "llm_not_ec_consumer"


class EcStorageTransport(EcStorageSpec, Transport):
    """The directory's store (an earlier run's files taken over when it is built) and the engine's
    fingerprint, which every uuid starts from."""

    def __init__(self, setup: Setup, store: EcStore | None = None):
        super().__init__(setup)
        config = setup.config
        if store is None:
            if (
                config.ec_storage_path is None
            ):  # vitserve/flags/handoff.py refuses this; a guard for direct callers
                raise ValueError("--llm_transport ec_storage needs --ec_storage_path")
            store = EcStore(
                Path(config.ec_storage_path),
                ttl_s=config.ec_ttl_s,
                max_bytes=int(config.ec_storage_gb * GIB),
                metrics=setup.metrics,
            )
        self.store = store
        self._fingerprint = ""

    def fingerprint(self) -> str:
        """The engine's fingerprint, asked once (the engine is ready before any chat request is served)."""
        if not self._fingerprint:
            self._fingerprint = self.setup.fingerprint()
        return self._fingerprint

    def begin(self) -> EcTicket:
        return EcTicket(self)


class EcTicket(Handover):
    """One request's files: each pinned from its lookup or write until `release` (which may be called more
    than once; only the first counts)."""

    reuses = True

    def __init__(self, transport: EcStorageTransport):
        self.transport = transport
        self.store = transport.store
        self.layout = transport.layout
        self.pinned: list[str] = []
        self.expected: list[tuple[str, int, int]] = []  # (uuid, rows, width) the request names
        self.hits: list[dict[str, Any] | None] = []  # per image: its part when its file was there
        self._released = False

    async def held(self, digests: list[str]) -> list[bool]:
        """Per image, whether its file is still there (then pinned, and its part in `hits`); an image that
        is not must be encoded. Looked up on the pool."""
        return await self.transport.setup.run(self.lookup, digests)  # type: ignore[no-any-return]

    def lookup(self, digests: list[str]) -> list[bool]:
        fingerprint = self.transport.fingerprint()
        for digest in digests:
            uuid = ec_uuid(fingerprint, "image", digest)
            entry = self.store.lookup(uuid)
            grid = entry.info.metadata.get("grid") if entry is not None else None
            if entry is None or grid is None:
                if entry is not None:
                    self.store.unpin([uuid])
                self.hits.append(None)
                continue
            self.pinned.append(uuid)
            self.hits.append(self._named(uuid, "image", json.loads(grid)))
        return [hit is not None for hit in self.hits]

    def reused_part(self, index: int) -> dict[str, Any] | None:
        return self.hits[index]

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        """The part for an image the engine encoded: its file written (checked first, as inline)."""
        tensor = llm_tensor(self.layout, result)
        check_tensor(self.layout, image, tensor, index)
        grid = [int(n) for n in image.item.grid_thw]
        uuid = ec_uuid(self.transport.fingerprint(), "image", image.image_id)
        self._write(uuid, tensor, {"kind": "image", "grid": json.dumps(grid)})
        return self._named(uuid, "image", grid)

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        """The part for a video: its file written unless it is still there."""
        tensor, grid = checked_video_tensor(self.layout, video, results, index)
        uuid = ec_uuid(self.transport.fingerprint(), "video", *(g.image_id for g in video.groups))
        if self.store.lookup(uuid) is not None:
            self.pinned.append(uuid)
        else:
            self._write(uuid, tensor, {"kind": "video", "grid": json.dumps(grid)})
        part = self._named(uuid, "video", grid)
        if self.layout.video_time == "timestamps":
            part["video_embeds"]["timestamps"] = video_timestamps(video)
        return part

    def _write(self, uuid: str, tensor: Any, metadata: dict[str, str]) -> None:
        self.store.pin(uuid)  # before the write: the sweep leaves its directory alone
        self.pinned.append(uuid)
        self.store.put(uuid, tensor, metadata)

    def _named(self, uuid: str, kind: str, grid: list[int]) -> dict[str, Any]:
        self.expected.append((uuid, self.layout.grid_rows(grid), self.layout.width))
        return {"type": f"{kind}_embeds", f"{kind}_embeds": {f"{kind}_grid_thw": grid}, "uuid": uuid}

    async def ready(self, payload: dict[str, Any]) -> bytes:
        """The fields vLLM hashes uuids with removed, every file checked just before: nothing goes upstream
        if one is gone."""
        strip(payload)
        await self.transport.setup.run(self.check)
        return await self.transport.body(payload)

    def check(self) -> None:
        """Every file the request names is there with its shape (EcFileMissing otherwise); then the
        directory's upkeep (handover/ec_store.py maintain)."""
        self.store.check(self.expected)
        self.store.maintain()

    def check_answer(self, status: int, content: bytes) -> None:
        check_answer(status, content)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.store.unpin(self.pinned)


def strip(payload: dict[str, Any]) -> None:
    """Remove the fields vLLM would hash the uuids with (the media were decoded here; they mean nothing to
    embeddings)."""
    for name in HASHED_FIELDS:
        payload.pop(name, None)


def check_answer(status: int, content: bytes) -> None:
    """A non-consumer's 400 for the metadata-only part becomes a 502 that says how to start vLLM."""
    if status == 400 and _NOT_CONSUMER in content:
        raise NotAConsumer(
            "the LLM server at --llm_url is not an encoder-cache consumer (it asked for the tensor of a "
            "metadata-only embedding part); start vLLM with --ec-transfer-config "
            '\'{"ec_connector":"ECExampleConnector","ec_role":"ec_consumer",'
            '"ec_connector_extra_config":{"shared_storage_path":"DIR"}}\' where DIR is vitserve\'s '
            "--ec_storage_path, or run vitserve with --llm_transport inline (docs/vllm.md)"
        )
