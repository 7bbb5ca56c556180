"""The batch scheduler: a pure FIFO token-budget packer (docs/design.md invariants 2 and 3).

No I/O, no torch, no asyncio, no threads: the engine owns the locking and calls these methods from one
place. Items are opaque hashable ids plus their token count (computed once, by the processor's
`count_tokens`, upstream).

Rules, and the bugs they exist to avoid:

* **Strict FIFO from the head.** `next_batch()` takes items from the head in arrival order and stops at
  the first item that does not fit the token budget or the image cap. That item *stays at the head*
  (we only peek at it), so it is the first item of the next batch. Nothing ever skips ahead to a
  smaller item behind it: skipping would starve large images under a steady stream of small ones, and
  any reordering desyncs tensor-parallel ranks that replay rank 0's decisions (LightLLM PR #1290:
  `infer_queue.put(task)` re-queued the rejected image at the *tail*, so rank 0 and rank N encoded
  different images; the fix was a `_put_front` that re-inserts at the head — peeking gives the same
  result without ever removing the item).
* **The first item is always admitted**, even when it alone is over the budget. The per-image cap
  upstream (docs/design.md invariant 1) normally guarantees it fits; if it ever did not, refusing it would
  leave it at the head forever and the queue would spin without progress. That is TEI issue #723: an
  entry larger than the batch budget was pushed back to the front on every iteration, an infinite loop
  that stalled the whole queue. Admitting it alone trades one over-budget batch for liveness.
* **Cancellation is lazy.** `cancel()` forgets the item in O(1); its slot in the deque is skipped when
  it reaches the head. Cancelled items are never reordered or re-queued, and `queued_tokens` /
  `queued_items` exclude them immediately.

* **Streams (fairness for videos).** `add_stream()` takes a video's temporal groups, in order. A stream
  keeps at most one batch's worth of them in the queue (tokens within the budget and no more items than the
  image cap; always at least one while it has any left); the rest wait beside the queue and enter at its
  tail, in order, as the queued ones are batched or cancelled. So an image that arrives behind a long video
  waits about one batch, not the whole video, and the video still fills every batch it gets. Streams refill
  in the order they were added. `queued_tokens` / `queued_items` count the waiting groups too (they are
  admitted work).

Every operation is O(1) amortised: each added entry is appended once and popped once (a refill looks only
at the streams that changed).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence


class Scheduler:
    """FIFO packer of items under a per-batch token budget and image cap.

    visual_batch_max_tokens: the most tokens in one batch (`--visual_batch_max_tokens`); 0 = unlimited.
    visual_infer_batch_size: the most items in one batch (`--visual_infer_batch_size`), >= 1.
    """

    def __init__(self, visual_batch_max_tokens: int, visual_infer_batch_size: int):
        if visual_batch_max_tokens < 0:
            raise ValueError(
                f"visual_batch_max_tokens must be >= 0 (0 = unlimited), got {visual_batch_max_tokens}"
            )
        if visual_infer_batch_size < 1:
            raise ValueError(f"visual_infer_batch_size must be >= 1, got {visual_infer_batch_size}")
        self.visual_batch_max_tokens = visual_batch_max_tokens
        self.visual_infer_batch_size = visual_infer_batch_size
        # Arrival order as (seq, item_id). An entry is live iff _live[item_id][0] == seq, so an id that
        # is cancelled and then added again is queued at the tail, not at its old position.
        self._order: deque[tuple[int, Hashable]] = deque()
        self._live: dict[Hashable, tuple[int, int]] = {}  # item_id -> (seq, tokens)
        self._seq = 0
        self._queued_tokens = 0  # queued + waiting in a stream
        # Streams: stream id -> its waiting (item_id, tokens) in order; item_id -> its stream while queued
        # or waiting; the window each stream has in the queue now, as [items, tokens].
        self._streams: dict[int, deque[tuple[Hashable, int]]] = {}
        self._waiting: dict[Hashable, int] = {}  # item_id -> tokens, for items still beside the queue
        self._stream_of: dict[Hashable, int] = {}
        self._window: dict[int, list[int]] = {}
        self._stream_ids = itertools.count()
        self._dirty: set[int] = set()  # streams whose window shrank since the last refill

    # -- queries ---------------------------------------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        """Tokens of the queued, non-cancelled items."""
        return self._queued_tokens

    @property
    def queued_items(self) -> int:
        """Number of queued, non-cancelled items (a stream's waiting items included)."""
        return len(self._live) + len(self._waiting)

    def __len__(self) -> int:
        return self.queued_items

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._live or item_id in self._waiting

    # -- commands --------------------------------------------------------------------------------
    def add(self, item_id: Hashable, tokens: int) -> None:
        """Queue an item at the tail. Raises ValueError for a duplicate live id or negative tokens."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens} for item {item_id!r}")
        if item_id in self:
            raise ValueError(f"item {item_id!r} is already queued")
        self._queued_tokens += tokens
        self._enqueue(item_id, tokens)

    def add_stream(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """Queue a stream of (item_id, tokens) in order (a video's temporal groups): one batch's worth
        enters the queue now, the rest as those leave it (see the module doc). Raises like add()."""
        ids = [item_id for item_id, _ in items]
        if len(set(ids)) != len(ids) or any(i in self for i in ids):
            raise ValueError(f"stream items {ids!r} repeat or are already queued")
        if any(tokens < 0 for _, tokens in items):
            raise ValueError(f"tokens must be >= 0, got {[t for _, t in items]}")
        if not items:
            return
        stream = next(self._stream_ids)
        self._streams[stream] = deque(items)
        self._window[stream] = [0, 0]
        for item_id, tokens in items:
            self._waiting[item_id] = tokens
            self._stream_of[item_id] = stream
            self._queued_tokens += tokens
        self._dirty.add(stream)
        self._refill()

    def _enqueue(self, item_id: Hashable, tokens: int) -> None:
        self._seq += 1
        self._live[item_id] = (self._seq, tokens)
        self._order.append((self._seq, item_id))

    def cancel(self, item_id: Hashable) -> bool:
        """Forget a queued item. True if it was queued; False if unknown, already batched or cancelled."""
        if item_id in self._waiting:  # its slot in the stream's deque is skipped at refill
            self._queued_tokens -= self._waiting.pop(item_id)
            # It may have been the stream's head that did not fit: the groups behind it may enter now, as
            # they would at any later refill (every stream is kept as full as its window allows).
            self._dirty.add(self._stream_of.pop(item_id))
            self._refill()
            return True
        entry = self._live.pop(item_id, None)
        if entry is None:
            return False
        self._queued_tokens -= entry[1]
        self._leave_stream(item_id, entry[1])
        self._refill()
        return True

    def next_batch(self) -> list[Hashable] | None:
        """The next batch of item ids in FIFO order, or None when nothing is queued.

        Takes items from the head while the running token sum stays within the budget and the batch
        has fewer than visual_infer_batch_size items; the first item is always taken (see the module doc).
        """
        batch: list[Hashable] = []
        batch_tokens = 0
        while len(batch) < self.visual_infer_batch_size:
            head = self._peek_live()
            if head is None:
                break
            item_id, tokens = head
            if (
                batch
                and self.visual_batch_max_tokens
                and batch_tokens + tokens > self.visual_batch_max_tokens
            ):
                break  # does not fit: it stays at the head and opens the next batch
            self._order.popleft()
            del self._live[item_id]
            self._queued_tokens -= tokens
            batch.append(item_id)
            batch_tokens += tokens
            self._leave_stream(item_id, tokens)
        self._refill()
        return batch or None

    def _leave_stream(self, item_id: Hashable, tokens: int) -> None:
        """An item left the queue (batched or cancelled): its stream's window shrank."""
        stream = self._stream_of.pop(item_id, None)
        if stream is None:
            return
        window = self._window[stream]
        window[0] -= 1
        window[1] -= tokens
        self._dirty.add(stream)

    def _refill(self) -> None:
        """Move waiting stream items into the queue while each stream's window has room, streams in the
        order they were added; a finished stream is forgotten."""
        for stream in sorted(self._dirty):
            waiting, window = self._streams[stream], self._window[stream]
            while waiting:
                item_id, tokens = waiting[0]
                if item_id not in self._waiting or self._stream_of.get(item_id) != stream:  # cancelled
                    waiting.popleft()
                    continue
                full = window[0] >= self.visual_infer_batch_size or (
                    self.visual_batch_max_tokens and window[1] + tokens > self.visual_batch_max_tokens
                )
                if window[0] and full:
                    break
                waiting.popleft()
                del self._waiting[item_id]
                window[0] += 1
                window[1] += tokens
                self._enqueue(item_id, tokens)
            if not waiting and not window[0]:
                del self._streams[stream], self._window[stream]
        self._dirty.clear()

    def _peek_live(self) -> tuple[Hashable, int] | None:
        """The live head (item_id, tokens), dropping cancelled entries in front of it."""
        while self._order:
            seq, item_id = self._order[0]
            entry = self._live.get(item_id)
            if entry is not None and entry[0] == seq:
                return item_id, entry[1]
            self._order.popleft()  # cancelled (or cancelled and re-added later): skip, never reorder
        return None
