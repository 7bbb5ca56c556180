"""The front door's encoder-cache hand-over (--llm_transport ec_storage, docs/vllm.md): each image and video of
a chat request becomes a file under --ec_storage_path (handover/ec_store.py) and a metadata-only part that
names it by uuid; vLLM, started as an EC consumer of that directory, loads the file instead of a tensor in the
body.

- An image's uuid comes from its bytes and the engine's fingerprint (handover/ec_files.py `ec_uuid`), so it is
  known before the image is decoded: an image whose file is still there is neither decoded, nor encoded, nor
  written again (`EcTicket.held`). A video's uuid comes from its groups' ids (its bytes and sampling); a video
  is encoded through the engine (whose cache may hold its groups) and its file written only if missing.
- The parts, the uuids, the fields removed and the answer read are every uuid transport's
  (handover/by_uuid.py). vLLM also hashes a uuid with its own server-level `--media-io-kwargs` for that
  modality and would then look for a file that is not there, which kills its engine: the consumer must not be
  started with --media-io-kwargs for a modality vitserve sends.
- Just before the request goes upstream every file it names is checked by its header (`EcTicket.ready`); the
  files stay pinned until the answer is complete (`EcTicket.release`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vitserve.config import GIB
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.handover.base import Setup
from vitserve.handover.by_uuid import UuidHandover, UuidTransport, strip
from vitserve.handover.ec_store import EcStore
from vitserve.handover.embeds import check_tensor, checked_video_tensor, llm_tensor
from vitserve.transport_specs import EcStorageSpec

CONSUMER_HINT = (
    "start vLLM with --ec-transfer-config "
    '\'{"ec_connector":"ECExampleConnector","ec_role":"ec_consumer",'
    '"ec_connector_extra_config":{"shared_storage_path":"DIR"}}\' where DIR is vitserve\'s '
    "--ec_storage_path, or run vitserve with --llm_transport inline (docs/vllm.md)"
)


class EcStorageTransport(EcStorageSpec, UuidTransport):
    """The directory's store (an earlier run's files taken over when it is built)."""

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

    def begin(self) -> EcTicket:
        return EcTicket(self)


class EcTicket(UuidHandover):
    """One request's files: each pinned from its lookup or write until `release` (which may be called more
    than once; only the first counts)."""

    not_consumer_hint = CONSUMER_HINT

    def __init__(self, transport: EcStorageTransport):
        super().__init__(transport)
        self.store = transport.store
        self.pinned: list[str] = []
        self.expected: list[tuple[str, int, int]] = []  # (uuid, rows, width) the request names
        self._released = False

    def holds(self, uuids: list[str]) -> list[list[int] | None]:
        """Per image, its grid when its file is still there (then pinned until `release`)."""
        grids: list[list[int] | None] = []
        for uuid in uuids:
            entry = self.store.lookup(uuid)
            grid = entry.info.metadata.get("grid") if entry is not None else None
            if entry is not None and grid is None:
                self.store.unpin([uuid])
            if grid is not None:
                self.pinned.append(uuid)
            grids.append(None if grid is None else json.loads(grid))
        return grids

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        """The part for an image the engine encoded: its file written (checked first, as inline)."""
        tensor = llm_tensor(self.layout, result)
        check_tensor(self.layout, image, tensor, index)
        grid = [int(n) for n in image.item.grid_thw]
        uuid = self.transport.uuid("image", image.image_id)
        self._write(uuid, tensor, {"kind": "image", "grid": json.dumps(grid)})
        return self.named(uuid, "image", grid)

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        """The part for a video: its file written unless it is still there."""
        tensor, grid = checked_video_tensor(self.layout, video, results, index)
        uuid = self.transport.uuid("video", *(g.image_id for g in video.groups))
        if self.store.lookup(uuid) is not None:
            self.pinned.append(uuid)
        else:
            self._write(uuid, tensor, {"kind": "video", "grid": json.dumps(grid)})
        return self.video_named(uuid, video, grid)

    def _write(self, uuid: str, tensor: Any, metadata: dict[str, str]) -> None:
        self.store.pin(uuid)  # before the write: the sweep leaves its directory alone
        self.pinned.append(uuid)
        self.store.put(uuid, tensor, metadata)

    def named(self, uuid: str, kind: str, grid: list[int]) -> dict[str, Any]:
        """The part, and its file's shape kept for the check just before sending."""
        self.expected.append((uuid, self.layout.grid_rows(grid), self.layout.width))
        return super().named(uuid, kind, grid)

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

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.store.unpin(self.pinned)
