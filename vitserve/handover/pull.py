"""--llm_transport pull (docs/vllm.md, "Pull"; SPEC §13): each image and video of a chat request is kept in this
replica's bounded store (handover/pull_store.py), served by a producer on --pull_bind (vitserve/connector/
producer.py, CURVE with --wire_key_file), and the request goes to vLLM (--llm_url, often a balancer in front of
several engines) with metadata-only parts and an announcement naming, per item, where to fetch it:

    "ec_transfer_params": {"vitserve": {"v": 1, "items": {uuid: {"rows", "width", "dtype", "producer"}}}}

Whichever engine gets the request, its vitserve connector fetches each item from `producer` (--pull_advertise)
before scheduling it. Nothing is pushed, so vitserve need not know which engine (or data-parallel rank) serves.

- The uuids, parts, stripped fields and the non-consumer's 400 are every uuid transport's (handover/by_uuid.py).
- An item is kept (pinned) before the request goes upstream and released when its answer is complete; a full
  store is vitserve's own 503 `pull_store_full`, before anything goes upstream.
- An image this replica still keeps is neither decoded, encoded nor kept again (`holds`).
- vLLM's bare 500 for a request its connector failed (an item not fetched: missing, unreachable, not admitted
  by its `pull_from`) is a 502 `llm_item_unavailable`, as for wire.
- The tensors are kept as the tower gives them; the connector casts them to vLLM's dtype when it loads them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid as uuid_mod
from typing import Any

import torch

from vitserve.config import GIB
from vitserve.connector.producer import Producer
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.handover.base import Setup
from vitserve.handover.by_uuid import UuidHandover, UuidTransport, strip
from vitserve.handover.embeds import EmbeddingMismatch, video_rows
from vitserve.handover.pull_store import PullStore
from vitserve.handover.same_host import pull_file
from vitserve.handover.wire import ItemUnavailable
from vitserve.rpc.tensors import dtype_name
from vitserve.rpc.wire import ImageEmbedding
from vitserve.rpc.wirekey import read_key_file
from vitserve.transport_specs import PullSpec

ANNOUNCEMENT_VERSION = 1  # of ec_transfer_params["vitserve"], as wire's


def consumer_hint(advertise: str, keyed: bool) -> str:
    """The vLLM side that matches this replica: the connector with `pull_from` admitting its host (and the key)."""
    host = advertise.partition("://")[2].rpartition(":")[0].strip("[]")
    extra: dict[str, Any] = {"pull_from": [host]}
    if keyed:
        extra["key_file"] = "FILE"
    config = {
        "ec_connector": "VitserveECConnector",
        "ec_connector_module_path": "vitserve.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": extra,
    }
    keyed_text = " (key_file: the secret --wire_key_file holds)" if keyed else ""
    return (
        f"start vLLM with --ec-transfer-config '{json.dumps(config, separators=(',', ':'))}'{keyed_text}, "
        'so its connector fetches from --pull_advertise (docs/vllm.md, "Pull")'
    )


class PullTransport(PullSpec, UuidTransport):
    """The store and its producer, for the app's lifetime."""

    def __init__(self, setup: Setup, store: PullStore | None = None):
        super().__init__(setup)
        config = setup.config
        if config.pull_bind is None:  # flags refuse this; a guard for direct callers
            raise ValueError("--llm_transport pull needs --pull_bind")
        self.store = store or PullStore(int(config.pull_store_gb * GIB))
        key = read_key_file(config.wire_key_file) if config.wire_key_file else None
        self.producer = Producer(config.pull_bind, self.store.find, key=key, to_file=pull_file)
        bound_port = self.producer.endpoint.rpartition(":")[2]
        advertise = config.pull_advertise or config.pull_bind
        if advertise.endswith(":0"):  # an ephemeral bind (tests): announce the port it got
            advertise = f"{advertise.rpartition(':')[0]}:{bound_port}"
        self.advertise = advertise
        self.hint = consumer_hint(advertise, key is not None)

    def begin(self) -> PullRequest:
        return PullRequest(self)

    async def close(self) -> None:
        await asyncio.to_thread(self.producer.close)


class PullRequest(UuidHandover):
    """One request's items: kept and pinned in `ready`, released with the answer."""

    def __init__(self, transport: PullTransport):
        super().__init__(transport)
        self.pull = transport
        self.request_id = f"chat-{uuid_mod.uuid4().hex}"
        self.messages: list[ImageEmbedding] = []
        self.items: dict[str, dict[str, Any]] = {}  # uuid -> its announcement
        self.pinned: list[str] = []

    @property
    def not_consumer_hint(self) -> str:  # type: ignore[override]
        return self.pull.hint

    def holds(self, uuids: list[str]) -> list[list[int] | None]:
        """Per image, its grid when this replica still keeps it (then pinned by this request)."""
        grids: list[list[int] | None] = []
        for uuid in uuids:
            message = self.pull.store.hold(uuid, self.request_id)
            if message is not None:
                message.expires_at = max(message.expires_at, self._expires_at())
                self.pinned.append(uuid)
                self._announce(message)
            grids.append(None if message is None else list(message.grid_thw))
        return grids

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        if result.embedding is None:
            raise EmbeddingMismatch("the engine returned no embedding for an image of a chat request")
        grid = [int(n) for n in image.item.grid_thw]
        uuid = self.pull.uuid("image", image.image_id)
        self._add(f"image {index}", uuid, image.image_id, grid, result.embedding, list(result.deepstack))
        return self.named(uuid, "image", grid)

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        main, deep = video_rows(results)
        grid = list(video.metadata.grid_thw)
        uuid = self.pull.uuid("video", *(g.image_id for g in video.groups))
        self._add(f"video {index}", uuid, video.video_id, grid, main, deep)
        return self.video_named(uuid, video, grid)

    def _add(
        self,
        what: str,
        uuid: str,
        item_id: str,
        grid: list[int],
        main: torch.Tensor,
        deep: list[torch.Tensor],
    ) -> None:
        """Refuse (500) rows or a width that are not what vLLM will assume; else the item joins the request."""
        self.layout.check_split(what, main, deep, grid)
        message = self._message(item_id, grid, main, deep, uuid, num_images=1)
        self.messages.append(message)
        self._announce(message)

    def _announce(self, message: ImageEmbedding) -> None:
        width = sum(int(t.shape[1]) for t in (message.embedding, *message.deepstack))
        self.items[message.uuid or ""] = {
            "rows": int(message.embedding.shape[0]),
            "width": width,
            "dtype": dtype_name(message.embedding.dtype),
            "producer": self.pull.advertise,
        }

    async def ready(self, payload: dict[str, Any]) -> bytes:
        """Every item kept (a full store: 503, and what was kept released), the fields vLLM hashes uuids with
        removed, the items announced."""
        strip(payload)
        payload["ec_transfer_params"] = {"vitserve": {"v": ANNOUNCEMENT_VERSION, "items": dict(self.items)}}
        try:
            for message in self.messages:
                message.num_images = len(self.messages)
                message.expires_at = self._expires_at()
                self.pull.store.keep(message, self.request_id)
                self.pinned.append(message.uuid or "")
        except BaseException:
            self.release()
            raise
        return await self.pull.body(payload)

    def _expires_at(self) -> float:
        """Until when a connector may keep what it fetched: this request's deadline (the wire's rule)."""
        return time.time() + self.pull.setup.config.request_timeout_s

    def check_answer(self, status: int, content: bytes) -> None:
        super().check_answer(status, content)
        if status == 500:
            raise ItemUnavailable(
                f"vLLM failed the request ({_error_message(content)}): with --llm_transport pull, what it "
                "answers when its connector could not fetch an item the request names from --pull_advertise "
                f"{self.pull.advertise} (not admitted by its pull_from, a key that differs, or no answer in its "
                "wait_s; vLLM's log says 'vitserve connector: request ... fails'). vLLM is healthy"
            )

    def release(self) -> None:
        pinned, self.pinned = self.pinned, []
        if pinned:
            self.pull.store.release(pinned, self.request_id)


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return content[:300].decode("utf-8", "replace")
