"""--llm_transport pull's store (docs/vllm.md, "Pull"): the embeddings this replica keeps for vLLM's connector to
fetch, in memory (nothing else reads them: the producer sends the tensors as they are), bounded to
--pull_store_gb with the connector's own bookkeeping (vitserve/connector/ledger.py, no I/O).

- A chat request keeps each of its items before it goes upstream (`keep`), pinned by the request until its
  answer is complete (`release`): a balancer's retry to another engine happens inside that call, so the second
  engine still finds it. Released, an item stays until KEEP_S later for a client's retry (a repeated image is
  then neither encoded nor kept again: `hold`), and is the first to go when an arrival needs room.
- A store full of pinned items refuses the request before anything goes upstream (`PullStoreFull`, 503 naming
  --pull_store_gb); what that request had kept is released.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from vitserve.connector.ledger import HeldTensor, Ledger
from vitserve.errors import VitserveError
from vitserve.rpc.tensors import dtype_name
from vitserve.rpc.wire import ImageEmbedding

KEEP_S = 60.0  # an item no request pins any more is kept this long for a client's retry
_NO_FILE = Path()  # the ledger's entries name a file; this store's are in memory


class PullStoreFull(VitserveError):
    """The embeddings kept for fetching fill --pull_store_gb with items requests still use."""

    status, code = 503, "pull_store_full"


def message_bytes(message: ImageEmbedding) -> int:
    return sum(t.numel() * t.element_size() for t in (message.embedding, *message.deepstack))


class PullStore:
    """uuid -> the message vLLM fetches; thread-safe (kept on the pool, found on the producer's thread)."""

    def __init__(self, max_bytes: int, keep_s: float = KEEP_S) -> None:
        self.ledger = Ledger(max_bytes)
        self.keep_s = keep_s
        self._messages: dict[str, ImageEmbedding] = {}
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("kept", "reused", "refused_full", "evicted", "expired"), 0)

    def keep(self, message: ImageEmbedding, request_id: str) -> None:
        """Keep `message` under its uuid, pinned by `request_id` (PullStoreFull when the bound has no room)."""
        uuid = message.uuid or ""
        now = time.time()
        with self._lock:
            if uuid in self._messages:  # another request kept it meanwhile: the same tensor (same uuid)
                self.ledger.renew(uuid, request_id, now + self.keep_s, now)
                self.ledger.pin(uuid, request_id, now)
                return
            nbytes = message_bytes(message)
            fits, expired, evicted = self.ledger.make_room(nbytes, now)
            self._drop(expired, "expired")
            self._drop(evicted, "evicted")
            if not fits:
                self.counts["refused_full"] += 1
                held = self.ledger.held_bytes
                raise PullStoreFull(
                    f"the embeddings kept for vLLM to fetch fill --pull_store_gb ({self.ledger.max_bytes / 2**30:g} "
                    f"GiB: {held / 2**30:.2f} GiB held by requests in flight, this item needs "
                    f"{nbytes / 2**20:.1f} MiB); nothing was sent to vLLM. Retry later, or raise --pull_store_gb",
                    retry_after_s=1.0,
                )
            entry = HeldTensor(
                path=_NO_FILE,
                dtype=dtype_name(message.embedding.dtype),
                rows=int(message.embedding.shape[0]),
                width=sum(int(t.shape[1]) for t in (message.embedding, *message.deepstack)),
                nbytes=nbytes,
                expires_at=now + self.keep_s,
            )
            self.ledger.add(uuid, entry, request_id, now)
            self.ledger.pin(uuid, request_id, now)
            self._messages[uuid] = message
            self.counts["kept"] += 1

    def hold(self, uuid: str, request_id: str) -> ImageEmbedding | None:
        """The message kept under uuid, pinned by `request_id` too (a repeated image), or None."""
        now = time.time()
        with self._lock:
            message = self._messages.get(uuid)
            if message is not None:
                self.ledger.renew(uuid, request_id, now + self.keep_s, now)
                self.ledger.pin(uuid, request_id, now)
                self.counts["reused"] += 1
            return message

    def release(self, uuids: list[str], request_id: str) -> None:
        """The request's answer is complete (or it failed): its pins end; the items stay KEEP_S, evictable."""
        now = time.time()
        with self._lock:
            for uuid in uuids:
                self.ledger.unpin(uuid, request_id, now + self.keep_s, now)
                self.ledger.release(uuid, request_id, now)
            self._drop(self.ledger.expire(now), "expired")

    def find(self, uuid: str) -> ImageEmbedding | None:
        """What the producer sends for a fetch of uuid (None: missing)."""
        with self._lock:
            return self._messages.get(uuid)

    @property
    def held_bytes(self) -> int:
        return self.ledger.held_bytes

    def __len__(self) -> int:
        return len(self._messages)

    def _drop(self, entries: list[HeldTensor], why: str) -> None:
        if not entries:
            return
        for uuid in [u for u in self._messages if u not in self.ledger.entries]:  # the ledger took them out
            del self._messages[uuid]
        self.counts[why] += len(entries)
