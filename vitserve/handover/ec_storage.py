"""The front door's encoder-cache hand-over (--llm_transport ec_storage, docs/vllm.md): each image and video of
a chat request becomes a file under --ec_storage_path (handover/ec_store.py) and a metadata-only part that names it
by uuid; vLLM, started as an EC consumer of that directory, loads the file instead of a tensor in the body.

- An image's uuid comes from its bytes and the engine's fingerprint (handover/ec_files.py `ec_uuid`), so it is
  known before the image is decoded: an image whose file is still there is neither decoded, nor encoded, nor
  written again (`image_hits`). A video's uuid comes from its groups' ids (its bytes and sampling); a video is
  encoded through the engine (whose cache may hold its groups) and its file written only if missing.
- Parts sent: `{"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": U}`; a video's
  `video_embeds` with `video_grid_thw` (and Qwen3-VL / Qwen3.5's `timestamps`, as inline).
- vLLM hashes a uuid together with a request's `mm_processor_kwargs` and `media_io_kwargs` (and with its own
  server-level `--media-io-kwargs` for that modality) and would then look for a file that is not there, which
  kills its engine: both fields are removed from the request (`strip`); the consumer must not be started with
  --media-io-kwargs for a modality vitserve sends.
- Just before the request goes upstream every file it names is checked by its header (`check`); the files
  stay pinned until the answer is complete (`EcTicket.release`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from vitserve.contract import ImageResult, PreparedImage, PreparedVideo
from vitserve.errors import VitserveError
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.ec_store import EcStore
from vitserve.handover.embeds import EmbedsLayout, check_tensor, checked_video_tensor, llm_tensor

# What a vLLM that is not an EC consumer answers a metadata-only part with (400).
_NOT_CONSUMER = b"The data should contain the fields"
# The request fields vLLM hashes a uuid with (vllm/multimodal/processing/inputs.py get_mm_hashes).
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


class NotAConsumer(VitserveError):
    """The LLM server refused a metadata-only embedding part: it was not started as an EC consumer."""

    status, code = 502, "llm_not_ec_consumer"


class EcTicket:
    """One request's files: each pinned from its lookup or write until `release` (which may be called more
    than once; only the first counts)."""

    def __init__(self, store: EcStore):
        self.store = store
        self.pinned: list[str] = []
        self.expected: list[tuple[str, int, int]] = []  # (uuid, rows, width) the request names
        self.hits: list[dict[str, Any] | None] = []  # per image: its part when its file was there
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.store.unpin(self.pinned)


class EcHandover:
    def __init__(self, store: EcStore, layout: EmbedsLayout, fingerprint: Callable[[], str]):
        self.store = store
        self.layout = layout
        self._engine_fingerprint = fingerprint  # the engine's, known once it is ready
        self._fingerprint = ""

    def fingerprint(self) -> str:
        """The engine's fingerprint, asked once (the engine is ready before any chat request is served)."""
        if not self._fingerprint:
            self._fingerprint = self._engine_fingerprint()
        return self._fingerprint

    def ticket(self) -> EcTicket:
        return EcTicket(self.store)

    def image_hits(self, ticket: EcTicket, blobs: list[bytes]) -> list[bool]:
        """Per image, whether its file is still there (then pinned, and its part in ticket.hits); an image
        that is not must be encoded."""
        out = ticket.hits
        fingerprint = self.fingerprint()
        for data in blobs:
            uuid = ec_uuid(fingerprint, "image", hashlib.sha256(data).hexdigest())
            entry = self.store.lookup(uuid)
            grid = entry.info.metadata.get("grid") if entry is not None else None
            if entry is None or grid is None:
                if entry is not None:
                    self.store.unpin([uuid])
                out.append(None)
                continue
            ticket.pinned.append(uuid)
            out.append(self._named(ticket, uuid, "image", json.loads(grid)))
        return [hit is not None for hit in out]

    def image_part(
        self, ticket: EcTicket, image: PreparedImage, result: ImageResult, index: int
    ) -> dict[str, Any]:
        """The part for an image the engine encoded: its file written (checked first, as inline)."""
        tensor = llm_tensor(self.layout, result)
        check_tensor(self.layout, image, tensor, index)
        grid = [int(n) for n in image.item.grid_thw]
        uuid = ec_uuid(self.fingerprint(), "image", image.image_id)
        self._write(ticket, uuid, tensor, {"kind": "image", "grid": json.dumps(grid)})
        return self._named(ticket, uuid, "image", grid)

    def video_part(
        self, ticket: EcTicket, video: PreparedVideo, results: list[ImageResult], index: int
    ) -> dict[str, Any]:
        """The part for a video: its file written unless it is still there."""
        tensor, grid = checked_video_tensor(self.layout, video, results, index)
        uuid = ec_uuid(self.fingerprint(), "video", *(g.image_id for g in video.groups))
        if self.store.lookup(uuid) is not None:
            ticket.pinned.append(uuid)
        else:
            self._write(ticket, uuid, tensor, {"kind": "video", "grid": json.dumps(grid)})
        part = self._named(ticket, uuid, "video", grid)
        if self.layout.video_time == "timestamps":
            part["video_embeds"]["timestamps"] = video.metadata["timestamps_s"]
        return part

    def _write(self, ticket: EcTicket, uuid: str, tensor: Any, metadata: dict[str, str]) -> None:
        self.store.pin(uuid)  # before the write: the sweep leaves its directory alone
        ticket.pinned.append(uuid)
        self.store.put(uuid, tensor, metadata)

    def _named(self, ticket: EcTicket, uuid: str, kind: str, grid: list[int]) -> dict[str, Any]:
        ticket.expected.append((uuid, self.layout.grid_rows(grid), self.layout.width))
        return {"type": f"{kind}_embeds", f"{kind}_embeds": {f"{kind}_grid_thw": grid}, "uuid": uuid}

    @staticmethod
    def strip(payload: dict[str, Any]) -> None:
        """Remove the fields vLLM would hash the uuids with (the media were decoded here; they mean nothing to
        embeddings)."""
        for name in HASHED_FIELDS:
            payload.pop(name, None)

    def check(self, ticket: EcTicket) -> None:
        """Every file the request names is there with its shape (EcFileMissing otherwise); then the
        directory's upkeep (handover/ec_store.py maintain)."""
        self.store.check(ticket.expected)
        self.store.maintain()

    @staticmethod
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
