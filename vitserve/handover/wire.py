"""The front door's hand-over over the wire (--llm_transport wire, docs/vllm.md): each image and video of a chat
request is pushed over ZMQ (docs/wire.md) to vitserve's own vLLM connector (vitserve/vllm_connector.py, bound at
--llm_endpoint) and acknowledged there BEFORE the request goes to vLLM (--llm_url) with metadata-only parts that
name it by uuid; the connector loads it into vLLM's encoder cache. No directory is shared, so vLLM may run on
another host and any number of replicas may feed one vLLM.

- The uuids and parts are ec_storage's (handover/ec_files.py `ec_uuid`, handover/ec_storage.py): an image's uuid comes from its
  bytes and the engine's fingerprint, a video's from its groups' ids. The message header carries it as `uuid`.
- One message per item: an image is its embedding and its DeepStack frames; a video is ONE message with the whole
  video's rows (grid [T, h, w]), its groups' rows joined in time order, each DeepStack level joined the same way.
- A repeated image: when this replica pushed it before (so knows its grid) and the connector says it still holds
  it (a holds query over the same connection, `image_hits`), it is neither decoded, encoded nor pushed again.
- Every message must be acknowledged by the request's deadline; otherwise nothing goes upstream: a refusal (nack)
  or no connector connected is a 502 naming the connector's --ec-transfer-config, a message sent and never
  acknowledged is 504 `llm_timeout`.
- vLLM's error for an item its connector could not provide (it failed the request through the connector's
  take_unavailable_requests: a bare 500) is a 502 in OpenAI's shape (`check_answer`); in a stream, which vLLM
  has begun with 200 already, its error event is relayed as it comes.
- `mm_processor_kwargs` / `media_io_kwargs` are removed as for ec_storage (vLLM would hash them into the uuid).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid as uuid_mod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vitserve.contract import ImageResult, PreparedImage, PreparedVideo
from vitserve.errors import LLMTimeout, VitserveError
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.ec_storage import EcHandover, NotAConsumer
from vitserve.handover.embeds import EmbeddingMismatch, EmbedsLayout
from vitserve.metrics import Metrics
from vitserve.rpc.sender import Delivery, LLMSender, WireRefused
from vitserve.rpc.wire import ImageEmbedding

CONNECT_WAIT_S = 2.0  # a request waits this long at most for a connector to be connected before its 502
HOLDS_WAIT_S = 1.0  # a holds query unanswered this long: every image is pushed again
KNOWN_ITEMS = 65_536  # uuids this replica pushed, with their grids (a repeated image's part needs its grid)
# What a vLLM that is not an EC consumer answers a metadata-only part with (400), as for ec_storage.
_NOT_CONSUMER = b"The data should contain the fields"
CONFIG_HINT = (
    'start vLLM with --ec-transfer-config \'{"ec_connector":"VitserveECConnector","ec_connector_module_path":'
    '"vitserve.vllm_connector","ec_role":"ec_consumer","ec_connector_extra_config":{"endpoint":"tcp://0.0.0.0:5600"}}\''
    " bound where --llm_endpoint points (docs/vllm.md)"
)


class ConnectorUnavailable(VitserveError):
    """vitserve's vLLM connector (--llm_endpoint) is not connected, or refused an embedding: nothing was sent to
    vLLM."""

    status, code = 502, "llm_connector_unavailable"


class ItemUnavailable(VitserveError):
    """vLLM failed the request because its connector could not provide an item it names."""

    status, code = 502, "llm_item_unavailable"


@dataclass
class WireTicket:
    """One request's messages: built while its parts are rewritten, pushed by `WireHandover.deliver`."""

    deadline: float  # time.monotonic(): the request's (what the connector keeps for it is kept until then)
    request_id: str = field(default_factory=lambda: f"chat-{uuid_mod.uuid4().hex}")
    messages: list[ImageEmbedding] = field(default_factory=list)
    hits: list[dict[str, Any] | None] = field(default_factory=list)  # per image: its part when held already

    def release(self) -> None:
        """Nothing is pinned here: the connector keeps each tensor until vLLM loaded it or it expired."""


class WireHandover:
    def __init__(
        self,
        sender: LLMSender,
        layout: EmbedsLayout,
        engine_info: Callable[[], Any],
        metrics: Metrics,
        request_timeout_s: float,
    ):
        self.sender = sender
        self.request_timeout_s = request_timeout_s
        self.layout = layout
        self.metrics = metrics
        self._engine_info = engine_info  # the engine's EngineInfo, known once it is ready
        self._fingerprint = ""
        self._model = ""
        self._known: OrderedDict[str, list[int]] = OrderedDict()  # uuid -> grid, of what this replica pushed

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def fingerprint(self) -> str:
        if not self._fingerprint:
            info = self._engine_info()
            self._fingerprint, self._model = info.fingerprint, info.model
        return self._fingerprint

    def ticket(self) -> WireTicket:
        """Made as the request starts: its deadline is the request's (--request_timeout_s from now)."""
        return WireTicket(time.monotonic() + self.request_timeout_s)

    # -------------------------------------------------------------- the parts (on the preprocessing pool)

    def image_hits(self, ticket: WireTicket, blobs: list[bytes]) -> list[bool]:
        """Per image, whether the connector still holds it (then its part is in ticket.hits): one holds query
        for the images this replica pushed before; an unanswered query means none is held."""
        fingerprint = self.fingerprint()
        uuids = [ec_uuid(fingerprint, "image", hashlib.sha256(data).hexdigest()) for data in blobs]
        known = [u for u in uuids if u in self._known]
        held = self.sender.holds(known, HOLDS_WAIT_S, deadline=ticket.deadline) if known else set()
        for u in uuids:
            ticket.hits.append(self._part(u, "image", self._known[u]) if u in held else None)
        return [hit is not None for hit in ticket.hits]

    def image_part(
        self, ticket: WireTicket, image: PreparedImage, result: ImageResult, index: int
    ) -> dict[str, Any]:
        """The part for an image the engine encoded; its message joins the ticket (checked first, as inline)."""
        if result.embedding is None:
            raise EmbeddingMismatch("the engine returned no embedding for an image of a chat request")
        grid = [int(n) for n in image.item.grid_thw]
        self._check(f"image {index}", result.embedding, result.deepstack, grid)
        uuid = ec_uuid(self.fingerprint(), "image", image.image_id)
        self._add(ticket, uuid, image.image_id, grid, result.embedding, list(result.deepstack))
        return self._part(uuid, "image", grid)

    def video_part(
        self, ticket: WireTicket, video: PreparedVideo, results: list[ImageResult], index: int
    ) -> dict[str, Any]:
        """The part for a video: one message with its groups' rows joined in time order."""
        if any(r.embedding is None for r in results):
            raise EmbeddingMismatch("the engine returned no embedding for a video group of a chat request")
        main = torch.cat([r.embedding for r in results if r.embedding is not None])  # (T*h*w/m^2, hidden)
        levels = len(results[0].deepstack) if results else 0
        deep = [torch.cat([r.deepstack[k] for r in results]) for k in range(levels)]
        grid = [int(x) for x in video.metadata["grid_thw"]]  # type: ignore[attr-defined]
        self._check(f"video {index}", main, deep, grid)
        uuid = ec_uuid(self.fingerprint(), "video", *(g.image_id for g in video.groups))
        self._add(ticket, uuid, video.video_id, grid, main, deep)
        part = self._part(uuid, "video", grid)
        if self.layout.video_time == "timestamps":
            part["video_embeds"]["timestamps"] = video.metadata["timestamps_s"]
        return part

    def _check(self, what: str, main: torch.Tensor, deep: Any, grid: list[int]) -> None:
        """Refuse (500) rows or a width that are not what vLLM will assume, before anything is sent."""
        rows = self.layout.grid_rows(grid)
        shapes = [tuple(t.shape) for t in (main, *deep)]
        width = sum(s[1] for s in shapes if len(s) == 2)
        if any(len(s) != 2 or s[0] != rows for s in shapes) or width != self.layout.width:
            raise EmbeddingMismatch(
                f"{what}: embedding of shapes {shapes}, but the LLM server expects ({rows}, {self.layout.width}) "
                f"for grid {grid} ({self.layout.family}); nothing was sent to it"
            )

    def _add(
        self,
        ticket: WireTicket,
        uuid: str,
        item_id: str,
        grid: list[int],
        main: torch.Tensor,
        deep: list[Any],
    ) -> None:
        ticket.messages.append(
            ImageEmbedding(
                request_id=ticket.request_id,
                image_index=len(ticket.messages),
                num_images=0,  # set in deliver, once every item is known
                image_id=item_id,
                grid_thw=(grid[0], grid[1], grid[2]),
                embedding=main.contiguous(),
                deepstack=[d.contiguous() for d in deep],
                model=self._model,
                uuid=uuid,
            )
        )

    def _part(self, uuid: str, kind: str, grid: list[int]) -> dict[str, Any]:
        return {"type": f"{kind}_embeds", f"{kind}_embeds": {f"{kind}_grid_thw": grid}, "uuid": uuid}

    strip = staticmethod(EcHandover.strip)

    # ------------------------------------------------------------------------ the push (event loop)

    async def deliver(self, ticket: WireTicket, deadline: float, traceparent: str | None) -> None:
        """Push every message of the request and return once the connector acknowledged them all. Raises
        ConnectorUnavailable (no connector, or a refusal) or LLMTimeout; nothing goes upstream then."""
        if not ticket.messages:
            return
        start = time.perf_counter()
        if not self.sender.reachable:
            wait = min(CONNECT_WAIT_S, max(deadline - time.monotonic(), 0.0))
            if not await asyncio.to_thread(self.sender.wait_reachable, wait):
                self._count("llm_connector_unavailable", len(ticket.messages))
                raise self._unreachable("no connector is connected")
        deliveries = []
        for message in ticket.messages:
            message.num_images, message.traceparent = len(ticket.messages), traceparent
            deliveries.append(self.sender.send(message, deadline=deadline))
        try:
            for d in deliveries:
                await self._acked(d)
        finally:
            for d in deliveries:
                d.acked.cancel()  # the rest are withdrawn when one failed or the client left
        for message in ticket.messages:
            self._remember(message.uuid or "", list(message.grid_thw))
        self.metrics.embedding_bytes_sent_total.inc(sum(d.nbytes for d in deliveries))
        self.metrics.stage_seconds.labels(stage="send").observe(time.perf_counter() - start)

    async def _acked(self, d: Delivery) -> None:
        try:
            await asyncio.wrap_future(d.acked)
        except WireRefused as exc:
            self._count("refused")
            raise self._unreachable(exc.message) from None
        except LLMTimeout:
            self._count("llm_timeout")
            if d.sent_at is None:  # never handed to a connector: it went away
                raise self._unreachable("no connector was connected until the deadline") from None
            raise
        except asyncio.CancelledError:
            self._count("withdrawn")
            raise
        self._count("delivered")

    def _count(self, outcome: str, n: int = 1) -> None:
        self.metrics.llm_messages_total.labels(outcome=outcome).inc(n)

    def _unreachable(self, why: str) -> ConnectorUnavailable:
        return ConnectorUnavailable(
            f"vitserve's vLLM connector at --llm_endpoint {self.endpoint} did not take the request's embeddings "
            f"({why}); nothing was sent to vLLM. Is vLLM running with its connector? {CONFIG_HINT}"
        )

    def _remember(self, uuid: str, grid: list[int]) -> None:
        self._known[uuid] = grid
        self._known.move_to_end(uuid)
        while len(self._known) > KNOWN_ITEMS:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------------------- vLLM's answer

    @staticmethod
    def check_answer(status: int, content: bytes) -> None:
        """A non-consumer's 400 for a metadata-only part, or vLLM's failure of the request, becomes vitserve's 502
        (OpenAI's shape) that says what to do. vLLM 0.32 answers a request its connector failed (an item that
        never arrived or was let go: take_unavailable_requests) with a bare 500 "Internal server error"; its log
        names the item ("vitserve connector: request ... fails")."""
        if status == 400 and _NOT_CONSUMER in content:
            raise NotAConsumer(
                "the LLM server at --llm_url is not an encoder-cache consumer (it asked for the tensor of a "
                f"metadata-only embedding part); {CONFIG_HINT}"
            )
        if status == 500:
            raise ItemUnavailable(
                f"vLLM failed the request ({_error_message(content)}): with --llm_transport wire, what it answers "
                "when its connector could not provide an embedding the request names (let go under its max_gb, "
                "or past its deadline; vLLM's log says 'vitserve connector: request ... fails'). vLLM is healthy; "
                "sending the request again pushes the embeddings again"
            )


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return content[:300].decode("utf-8", "replace")
