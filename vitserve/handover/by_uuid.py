"""What the transports that name each item by uuid share (ec_storage, wire; pull next): the LLM server gets a
metadata-only part per image or video, `{"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]},
"uuid": U}` (a video's `video_embeds` with `video_grid_thw`, and Qwen3-VL / Qwen3.5's `timestamps`), and its
encoder-cache connector loads the embedding named U. Each transport keeps only how the bytes travel.

- The uuids (handover/ec_files.py `ec_uuid`): an image's from its bytes and the engine's fingerprint, so it is
  known before the image is decoded; a video's from its groups' ids. `UuidTransport.uuid`.
- The holds query: before decoding, per image, whether the LLM side still holds its uuid
  (`UuidHandover.holds`, the transport's own: a file still there, a connector that still keeps it); a held
  image is neither decoded, nor encoded, nor sent again, and its part is the one `held` kept.
- vLLM hashes a uuid together with a request's `mm_processor_kwargs` and `media_io_kwargs`, and would then look
  for an item that is not there: both fields are removed (`strip`).
- The answer: a vLLM that is not an EC consumer answers a metadata-only part with a 400 (`NOT_CONSUMER`), which
  becomes a 502 `llm_not_ec_consumer` saying how to start vLLM for this transport (`not_consumer_hint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vitserve.contract import PreparedVideo
from vitserve.errors import VitserveError
from vitserve.handover.base import Handover, Setup, Transport
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.embeds import EmbedsLayout, video_timestamps
from vitserve.rpc.wire import ImageEmbedding

# What a vLLM that is not an EC consumer answers a metadata-only part with (400).
NOT_CONSUMER = b"The data should contain the fields"
# The request fields vLLM hashes a uuid with (vllm/multimodal/processing/inputs.py get_mm_hashes).
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


class NotAConsumer(VitserveError):
    """The LLM server refused a metadata-only embedding part: it was not started as an EC consumer."""

    status, code = 502, "llm_not_ec_consumer"


class UuidTransport(Transport):
    """A transport whose items are named by uuid: the engine's fingerprint, which every uuid starts from."""

    def __init__(self, setup: Setup):
        super().__init__(setup)
        self._fingerprint = ""

    def fingerprint(self) -> str:
        """The engine's fingerprint, asked once (the engine is ready before any chat request is served)."""
        if not self._fingerprint:
            self._fingerprint = self.setup.fingerprint()
        return self._fingerprint

    def uuid(self, kind: str, *ids: str) -> str:
        """An image's uuid (kind "image", its sha256) or a video's ("video", its groups' ids in time order)."""
        return ec_uuid(self.fingerprint(), kind, *ids)


class UuidHandover(Handover):
    """One request's metadata-only parts. A subclass answers the holds query (`holds`) and says how vLLM is
    started as this transport's consumer (`not_consumer_hint`); `named` is where it sees every part made."""

    reuses = True
    not_consumer_hint: str  # the 502's advice: how to start vLLM as this transport's consumer
    request_id: str  # what the connector knows this chat request by (a subclass names it)
    messages: list[ImageEmbedding]  # the items' wire messages, in the request's order (a subclass keeps them)

    def __init__(self, transport: UuidTransport):
        self.transport = transport
        self.layout: EmbedsLayout = transport.layout
        self.hits: list[dict[str, Any] | None] = []  # per image: its part when the LLM side holds it

    async def held(self, digests: list[str]) -> list[bool]:
        """Per image, whether the LLM side holds it (then its part is in `hits`); looked up on the pool."""
        return await self.transport.setup.run(self.lookup, digests)  # type: ignore[no-any-return]

    def lookup(self, digests: list[str]) -> list[bool]:
        uuids = [self.transport.uuid("image", digest) for digest in digests]
        grids = self.holds(uuids)
        pairs = zip(uuids, grids, strict=True)
        self.hits = [None if grid is None else self.named(uuid, "image", grid) for uuid, grid in pairs]
        return [hit is not None for hit in self.hits]

    def holds(self, uuids: list[str]) -> list[list[int] | None]:
        """The holds query: per image uuid, its grid when the LLM side holds it and keeps it for this request,
        else None (then the image is encoded)."""
        raise NotImplementedError

    def reused_part(self, index: int) -> dict[str, Any] | None:
        return self.hits[index] if index < len(self.hits) else None

    def _message(self, item_id: str, grid: Sequence[int], main: torch.Tensor, deep: Sequence[torch.Tensor],
                 uuid: str, num_images: int) -> ImageEmbedding:  # fmt: skip
        """The next item's wire message (its tensors contiguous, its index the next of `messages`)."""
        return ImageEmbedding(
            request_id=self.request_id,
            image_index=len(self.messages),
            num_images=num_images,
            image_id=item_id,
            grid_thw=(grid[0], grid[1], grid[2]),
            embedding=main.contiguous(),
            deepstack=[d.contiguous() for d in deep],
            model=self.transport.setup.config.model,
            uuid=uuid,
        )

    def named(self, uuid: str, kind: str, grid: list[int]) -> dict[str, Any]:
        """The metadata-only part naming `uuid` (kind "image" or "video"), grid [t, h, w]."""
        return {"type": f"{kind}_embeds", f"{kind}_embeds": {f"{kind}_grid_thw": grid}, "uuid": uuid}

    def video_named(self, uuid: str, video: PreparedVideo, grid: list[int]) -> dict[str, Any]:
        """A video's part, with each group's `timestamps` where the family has them (as inline)."""
        part = self.named(uuid, "video", grid)
        if self.layout.video_time == "timestamps":
            part["video_embeds"]["timestamps"] = video_timestamps(video)
        return part

    def check_answer(self, status: int, content: bytes) -> None:
        """A non-consumer's 400 for the metadata-only part becomes a 502 that says how to start vLLM."""
        if status == 400 and NOT_CONSUMER in content:
            raise NotAConsumer(
                "the LLM server at --llm_url is not an encoder-cache consumer (it asked for the tensor of a "
                f"metadata-only embedding part); {self.not_consumer_hint}"
            )


def strip(payload: dict[str, Any]) -> None:
    """Remove the fields vLLM would hash the uuids with (the media were decoded here; they mean nothing to
    embeddings)."""
    for name in HASHED_FIELDS:
        payload.pop(name, None)
