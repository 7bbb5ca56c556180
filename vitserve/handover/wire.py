"""--llm_transport wire (docs/vllm.md, "The wire hand-over"): each image and video of a chat request is pushed
over ZMQ (docs/wire.md) to vitserve's own vLLM connector (vitserve/connector/glue.py, bound at --llm_endpoint)
and acknowledged there BEFORE the request goes to vLLM (--llm_url) with metadata-only parts that name it by
uuid; the connector loads it into vLLM's encoder cache. No directory is shared, so vLLM may run on another
host and any number of replicas may feed one vLLM.

- The uuids, parts, holds lookup and "not a consumer" answer are those of every uuid transport
  (handover/by_uuid.py, the base it shares with ec_storage and pull): an image's
  uuid comes from its bytes and the engine's fingerprint, a video's from its groups' ids. The message header
  carries it as `uuid`.
- One message per item: an image is its embedding and its DeepStack frames; a video is ONE message with the
  whole video's rows (grid [T, h, w]), its groups' rows joined in time order, each DeepStack level likewise.
- A repeated image: when this replica pushed it before (so knows its grid and dtype) and the connector says it
  still holds it (a holds query over the same connection, `held`), it is neither decoded, encoded nor pushed
  again; the query keeps it there until the request's deadline.
- The request tells the connector which of its items are vitserve's, as vLLM's own EC connectors do: the body's
  `ec_transfer_params` is {"vitserve": {"v": 1, "items": {uuid: {"rows", "width", "dtype"}}}}, one entry per
  metadata-only part, as pushed (a client's own `ec_transfer_params` is replaced). The connector supplies only
  announced items whose tensor matches.
- Every message must be acknowledged by the request's deadline; otherwise nothing goes upstream: a refusal
  (nack) or no connector connected is a 502 naming the connector's --ec-transfer-config (or, when the handshake
  failed, why: a key that differs), a message sent and never acknowledged is 504 `llm_timeout`. A request that
  fails before it goes upstream releases what it pushed at once (`LLMSender.release`).
- vLLM's error for an item its connector could not provide (it failed the request through the connector's
  take_unavailable_requests: a bare 500) is a 502 in OpenAI's shape (`check_answer`); in a stream, which vLLM
  has begun with 200 already, its error event is relayed as it comes.
- `mm_processor_kwargs` / `media_io_kwargs` are removed as for ec_storage (vLLM would hash them into the uuid).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import threading
import time
import uuid as uuid_mod
from collections import OrderedDict
from typing import Any

import torch

from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.endpoints import host_only, rank_endpoint
from vitserve.errors import VitserveError
from vitserve.handover.base import Setup
from vitserve.handover.by_uuid import UuidHandover, UuidTransport, strip
from vitserve.handover.embeds import EmbeddingMismatch, video_rows
from vitserve.handover.wire_ranks import Rank, Ranks
from vitserve.rpc.delivery import Unsent, WireRefused, settle
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.tensors import DTYPES, dtype_name
from vitserve.rpc.wire import ImageEmbedding
from vitserve.transport_specs import WireSpec

CONNECT_WAIT_S = 2.0  # a request waits this long at most for a connector to be connected before its 502
HOLDS_WAIT_S = 1.0  # a holds query unanswered this long: every image is pushed again
KNOWN_ITEMS = 65_536  # uuids this replica pushed, with their grids (a repeated image's part needs its grid)
ANNOUNCEMENT_VERSION = 1  # of ec_transfer_params["vitserve"]


def config_hint(endpoint: str, key_file: str | None, dp_size: int = 1) -> str:
    """The vLLM side that matches this vitserve: bound where --llm_endpoint points (its port on all interfaces
    when that is a host name) and keyed with --wire_key_file's file; keyless only on an endpoint only this host
    reaches, as vitserve itself (flags/handoff.py) and the connector's protected mode require. With --llm_dp_size
    N: `dp_push` and --data-parallel-size N (each core binds the port + its rank)."""
    bind = endpoint
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and not host_only(endpoint) and not _is_ip(host):
        bind = f"tcp://0.0.0.0:{port}"  # ZMQ binds an address or an interface, not a host name
    extra: dict[str, Any] = {"endpoint": bind}
    if key_file is not None:
        extra["key_file"] = key_file
    if dp_size > 1:
        extra["dp_push"] = True
    config = {
        "ec_connector": "VitserveECConnector",
        "ec_connector_module_path": "vitserve.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": extra,
    }
    keyed = f" and key_file the secret --wire_key_file {key_file} holds" if key_file else ""
    dp = f" --data-parallel-size {dp_size}" if dp_size > 1 else ""
    return (
        f"start vLLM with{dp} --ec-transfer-config '{json.dumps(config, separators=(',', ':'))}': the connector "
        f'bound where --llm_endpoint points{keyed} (docs/vllm.md, "The wire hand-over")'
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class ConnectorUnavailable(VitserveError):
    """vitserve's vLLM connector (--llm_endpoint) is not connected, or refused an embedding: nothing was sent to
    vLLM."""

    status, code = 502, "llm_connector_unavailable"


class ItemUnavailable(VitserveError):
    """vLLM failed the request because its connector could not provide an item it names."""

    status, code = 502, "llm_item_unavailable"


class WireTransport(WireSpec, UuidTransport):
    """The DEALER connected to the connector (one per data-parallel rank: handover/wire_ranks.py), and the grids
    of what this replica pushed."""

    def __init__(self, setup: Setup, sender: LLMSender | None = None):
        super().__init__(setup)
        config = setup.config
        if sender is None:
            if config.llm_endpoint is None:  # flags refuse this; a guard for direct callers
                raise ValueError("--llm_transport wire needs --llm_endpoint")
            ends = [rank_endpoint(config.llm_endpoint, i) for i in range(config.llm_dp_size or 1)]
            senders = [
                LLMSender(end, key_file=config.wire_key_file, security=config.wire_security or "curve")
                for end in ends
            ]
        else:
            senders = [sender]
        # per rank: one write on one host; vLLM's dtype on the wire (same_host.py)
        self.ranks = Ranks(senders)
        self.sender, self.handoff = self.ranks.all[0].sender, self.ranks.all[0].handoff  # rank 0's
        self.hint = config_hint(self.sender.endpoint, config.wire_key_file, len(self.ranks))
        self._known: OrderedDict[str, tuple[list[int], str]] = OrderedDict()  # uuid -> grid, dtype
        self._lock = threading.Lock()  # parts are made on the pool's threads

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def begin(self) -> WireRequest:
        """A request's hand-over; its deadline is the request's (--request_timeout_s from now)."""
        return WireRequest(self, time.monotonic() + self.setup.config.request_timeout_s)

    def readiness(self) -> str | None:
        """Why /ready is 503: a rank's connector not connected (or why its handshake failed: a key that
        differs)."""
        for rank in self.ranks.not_connected():
            where = f"--llm_endpoint {self.endpoint}"
            if len(self.ranks) > 1:
                where = f"{rank.endpoint} (data-parallel rank {rank.index} of --llm_dp_size {len(self.ranks)}, {where})"
            if rank.sender.link.refusal is not None:
                return f"the vitserve connector at {where} is not connected: {unreachable(rank.sender)}"
            return f"no vitserve connector is connected at {where}"
        return None

    def unreachable(self) -> str:
        return unreachable(self.sender)

    def known(self, uuid: str) -> tuple[list[int], str] | None:
        """The grid and dtype of an item this replica pushed."""
        with self._lock:
            return self._known.get(uuid)

    def remember(self, uuid: str, grid: list[int], dtype: str) -> None:
        with self._lock:
            self._known[uuid] = (grid, dtype)
            self._known.move_to_end(uuid)
            while len(self._known) > KNOWN_ITEMS:
                self._known.popitem(last=False)

    async def close(self) -> None:
        await asyncio.to_thread(self.ranks.close)


def unreachable(sender: LLMSender) -> str:
    return sender.link.refusal or "no connector is connected"


class WireRequest(UuidHandover):
    """One request's messages: made with its parts, pushed and acknowledged in `ready`."""

    transport: WireTransport

    def __init__(self, transport: WireTransport, deadline: float):
        super().__init__(transport)
        self.rank: Rank | None = transport.ranks.pick()  # None once released
        self.sender, self.handoff = self.rank.sender, self.rank.handoff  # its engine core's connector
        self.not_consumer_hint = transport.hint
        self.metrics = transport.setup.metrics
        self.deadline = deadline  # time.monotonic()
        self.request_id = f"chat-{uuid_mod.uuid4().hex}"
        self.messages: list[ImageEmbedding] = []
        self.items: dict[str, dict[str, Any]] = {}  # uuid -> its announcement (rows, width, dtype)
        self.pushed = False  # its messages went to the sender: a failure releases them

    # -------------------------------------------------------------- the parts (on the preprocessing pool)

    def holds(self, uuids: list[str]) -> list[list[int] | None]:
        """One holds query for the images this replica pushed before (an unanswered one means none is held);
        each held one is announced as it was pushed."""
        known = {u: k for u in uuids if (k := self.transport.known(u)) is not None}
        sender = self.sender
        held = sender.holds(list(known), HOLDS_WAIT_S, deadline=self.deadline) if known else set()
        for u in held & set(known):
            grid, dtype = known[u]
            self.items[u] = _announced(self.layout.grid_rows(grid), self.layout.width, dtype)
        return [known[u][0] if u in held else None for u in uuids]

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        """The part for an image the engine encoded; its message joins the request (checked first)."""
        if result.embedding is None:
            raise EmbeddingMismatch("the engine returned no embedding for an image of a chat request")
        grid = [int(n) for n in image.item.grid_thw]
        self.layout.check_split(f"image {index}", result.embedding, list(result.deepstack), grid)
        uuid = self.transport.uuid("image", image.image_id)
        self._add(uuid, image.image_id, grid, result.embedding, list(result.deepstack))
        return self.named(uuid, "image", grid)

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        """The part for a video: one message with its groups' rows joined in time order."""
        main, deep = video_rows(results)
        grid = list(video.metadata.grid_thw)
        self.layout.check_split(f"video {index}", main, deep, grid)
        uuid = self.transport.uuid("video", *(g.image_id for g in video.groups))
        self._add(uuid, video.video_id, grid, main, deep)
        return self.video_named(uuid, video, grid)

    def _add(
        self, uuid: str, item_id: str, grid: list[int], main: torch.Tensor, deep: list[torch.Tensor]
    ) -> None:
        width = sum(int(t.shape[1]) for t in (main, *deep))
        dtype = dtype_name(self.handoff.dtype(main.dtype))  # what it travels in: vLLM's dtype
        self.items[uuid] = _announced(int(main.shape[0]), width, dtype)
        self.messages.append(self._message(item_id, grid, main, deep, uuid, num_images=0))  # set in deliver

    # ------------------------------------------------------------------------ the push (event loop)

    async def ready(self, payload: dict[str, Any]) -> bytes:
        """The fields vLLM hashes uuids with removed, every embedding pushed and acknowledged, the items
        announced: nothing goes upstream if one is not, and what was pushed is released."""
        strip(payload)
        payload["ec_transfer_params"] = self.announcement()
        try:
            await self.deliver()
            return await self.transport.body(payload)
        except BaseException:  # a refusal, a timeout, the client gone (cancelled): nothing goes upstream
            self.release_pushed()
            raise

    def announcement(self) -> dict[str, Any]:
        """The request's `ec_transfer_params`: which items are vitserve's, as pushed."""
        return {"vitserve": {"v": ANNOUNCEMENT_VERSION, "items": dict(self.items)}}

    def release_pushed(self) -> None:
        """Tell the connector to let go of this request's messages now (fire and forget)."""
        if self.pushed:
            self.pushed = False
            uuids = list(dict.fromkeys(m.uuid for m in self.messages if m.uuid))
            self.sender.release(self.request_id, uuids)

    async def deliver(self) -> None:
        """Push every message and return once the connector acknowledged them all. Raises
        ConnectorUnavailable (no connector, or a refusal) or LLMTimeout."""
        if not self.messages:
            return
        start = time.perf_counter()
        sender = self.sender
        if not sender.reachable:
            wait = min(CONNECT_WAIT_S, max(self.deadline - time.monotonic(), 0.0))
            if not await asyncio.to_thread(sender.wait_reachable, wait):
                self.metrics.llm_messages_total.labels(outcome="llm_connector_unavailable").inc(
                    len(self.messages)
                )
                raise self._unreachable(unreachable(sender))
        deliveries = []
        self.pushed = True
        for message in self.messages:
            message.num_images = len(self.messages)
            dtype = DTYPES[self.items[message.uuid or ""]["dtype"]]
            deliveries.append(self.handoff.send(message, self.deadline, dtype))
        try:
            await settle(deliveries, self.metrics.llm_messages_total)
        except WireRefused as exc:
            raise ConnectorUnavailable(
                f"{exc.message}; nothing was sent to vLLM, and the request's other embeddings were released. "
                "Its limits (max_gb, shm_dir and that device's size, docs/vllm.md \"The connector's limits\") "
                "are in vLLM's --ec-transfer-config"
            ) from None
        except Unsent:  # never handed to a connector: none was there, or it went away
            why = sender.link.refusal or "no connector was connected until the deadline"
            raise self._unreachable(why) from None
        for message in self.messages:
            uuid = message.uuid or ""
            self.transport.remember(uuid, list(message.grid_thw), self.items[uuid]["dtype"])
        self.metrics.embedding_bytes_sent_total.inc(sum(d.nbytes for d in deliveries))
        self.metrics.stage_seconds.labels(stage="send").observe(time.perf_counter() - start)

    def _unreachable(self, why: str) -> ConnectorUnavailable:
        return ConnectorUnavailable(
            f"vitserve's vLLM connector at {self._where()} did not take the request's "
            f"embeddings ({why}); nothing was sent to vLLM. Is vLLM running with its connector? "
            f"{self.transport.hint}"
        )

    def _where(self) -> str:
        if len(self.transport.ranks) == 1:
            return f"--llm_endpoint {self.sender.endpoint}"
        return f"{self.sender.endpoint} (data-parallel rank {self.rank.index if self.rank else '?'})"

    def upstream_headers(self) -> dict[str, str]:
        """vLLM's X-data-parallel-rank: the engine core whose connector has this request's embeddings."""
        return self.transport.ranks.headers(self.rank) if self.rank is not None else {}

    def release(self) -> None:
        """The request's answer came (or it failed): its rank has one request fewer in flight."""
        rank, self.rank = self.rank, None
        if rank is not None:
            self.transport.ranks.done(rank)

    def check_answer(self, status: int, content: bytes) -> None:
        """A non-consumer's 400 (the base), or vLLM's failure of the request, becomes vitserve's 502 (OpenAI's
        shape) that says what to do."""
        super().check_answer(status, content)
        check_answer(status, content)


def _announced(rows: int, width: int, dtype: str) -> dict[str, Any]:
    return {"rows": rows, "width": width, "dtype": dtype}


def check_answer(status: int, content: bytes) -> None:
    """vLLM's failure of a request becomes vitserve's 502 llm_item_unavailable. vLLM 0.32 answers a request its
    connector failed (an item that never arrived or was let go: take_unavailable_requests) with a bare 500
    "Internal server error"; its log names the item ("vitserve connector: request ... fails")."""
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
