"""The connector's bookkeeping, with no I/O: which tensors are held, who still needs each one, and which may go.
Every operation is O(1) (amortized, and O(k) for the k entries it drops): a running byte total, the expiries in a
heap (lazy deletion: a changed time pushes a new item, a popped item that no longer matches is skipped), and the
spent entries in an ordered set, oldest first. The store calls it under its lock and deletes the files of the
entries a call returns.

Who needs an entry:
- a claim per push: each acknowledged message adds its `request_id` (at most MAX_CLAIMS per entry, the newest
  kept). A request of vLLM that loads the entry ends the oldest claim (`unpin`); a release message ends the
  named request's claim (it failed, and will not load it);
- a pin per scheduled vLLM request that names it (`pin` ... `unpin`);
- a promise: a holds reply promised it until a time (the query's expires_at, never past max_hold_s), even if a
  request loads it in between.
An entry with none of these is SPENT: evicted, oldest spent first, when an arrival needs room. Any unpinned entry
is dropped at its expiry (`expires_at`, never further than max_hold_s from the message or query that set it).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_CLAIMS = 64  # request ids kept per entry (a uuid pushed by many requests at once keeps the newest)


@dataclass
class HeldTensor:
    """One embedding held: its file and what a request needs to check it against."""

    path: Path
    dtype: str
    rows: int
    width: int
    nbytes: int
    expires_at: float  # Unix time; an unpinned entry past it is dropped
    pins: set[str] = field(default_factory=set)  # vLLM request ids that will load it now
    claims: dict[str, None] = field(
        default_factory=dict
    )  # pushes (sender request ids) not loaded nor released
    promised_until: float = 0.0  # Unix time: a holds reply promised it; never evicted before

    @property
    def loaded(self) -> bool:  # every push that claimed it was loaded or released
        return not self.claims


class Ledger:
    """The entries and their order; not thread-safe (the store holds its lock around every call)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: dict[str, HeldTensor] = {}
        self.held_bytes = 0
        self._spent: OrderedDict[str, None] = OrderedDict()  # oldest spent first
        self._timers: list[tuple[float, int, str]] = []  # (when, tie-break, uuid): expiry or a promise's end
        self._seq = itertools.count()

    # ------------------------------------------------------------------ changes

    def add(self, uuid: str, entry: HeldTensor, request_id: str, now: float) -> None:
        assert uuid not in self.entries
        self.entries[uuid] = entry
        self.held_bytes += entry.nbytes
        self._claim(entry, request_id)
        self._timer(entry.expires_at, uuid)
        self._review(uuid, now)

    def renew(self, uuid: str, request_id: str, expires_at: float, now: float) -> None:
        """The same tensor pushed again: one more claim, kept at least until expires_at."""
        entry = self.entries[uuid]
        self._claim(entry, request_id)
        self._extend(uuid, entry, expires_at)
        self._review(uuid, now)

    def pin(self, uuid: str, request_id: str, now: float) -> HeldTensor | None:
        entry = self.entries.get(uuid)
        if entry is not None:
            entry.pins.add(request_id)
            self._review(uuid, now)
        return entry

    def unpin(self, uuid: str, request_id: str, keep_until: float, now: float) -> None:
        """A vLLM request that named it finished: its pin and the oldest push's claim end."""
        entry = self.entries.get(uuid)
        if entry is None:
            return
        if request_id in entry.pins:
            entry.pins.discard(request_id)
            if entry.claims:
                del entry.claims[next(iter(entry.claims))]
        self._extend(uuid, entry, keep_until)
        if entry.expires_at <= now and not entry.pins:
            self._timer(now, uuid)  # it expired while pinned: the next sweep drops it
        self._review(uuid, now)

    def touch(self, uuid: str, until: float) -> HeldTensor | None:
        entry = self.entries.get(uuid)
        if entry is not None:
            self._extend(uuid, entry, until)
        return entry

    def promise(self, uuid: str, until: float, now: float) -> bool:
        """A holds reply names it: never evicted before `until`, kept at least as long. False: not held."""
        entry = self.entries.get(uuid)
        if entry is None:
            return False
        if until > entry.promised_until:
            entry.promised_until = until
            self._timer(until, uuid)
        self._extend(uuid, entry, until)
        self._review(uuid, now)
        return True

    def release(self, uuid: str, request_id: str, now: float) -> None:
        entry = self.entries.get(uuid)
        claim = request_id[:_CLAIM_CHARS]
        if entry is not None and claim in entry.claims:
            del entry.claims[claim]
            self._review(uuid, now)

    def remove(self, uuid: str) -> HeldTensor:
        """Take an entry out (replaced by another shape, or its file is gone); the caller deletes the file."""
        entry = self.entries.pop(uuid)
        self.held_bytes -= entry.nbytes
        self._spent.pop(uuid, None)
        return entry

    # ------------------------------------------------------------------ what goes

    def expire(self, now: float) -> list[HeldTensor]:
        """The unpinned entries past their expiry, taken out; promises that ended make entries spent."""
        gone = []
        while self._timers and self._timers[0][0] <= now:
            _, _, uuid = heapq.heappop(self._timers)
            entry = self.entries.get(uuid)
            if entry is None:
                continue  # a stale timer of an entry already gone
            if entry.expires_at <= now and not entry.pins:
                gone.append(self.remove(uuid))
            else:
                self._review(uuid, now)
        if len(self._timers) > 2 * len(self.entries) + 1024:
            self._compact()
        return gone

    def make_room(self, nbytes: int, now: float) -> tuple[bool, list[HeldTensor], list[HeldTensor]]:
        """Whether nbytes fit in the bound after dropping what expired and evicting spent entries, oldest first;
        and the entries (expired, evicted) taken out."""
        expired = self.expire(now)
        evicted = self.evict(self.held_bytes + nbytes - self.max_bytes)
        return self.held_bytes + nbytes <= self.max_bytes, expired, evicted

    def evict(self, nbytes: int) -> list[HeldTensor]:
        """Spent entries, oldest first, until at least nbytes are freed (or none is left)."""
        evicted: list[HeldTensor] = []
        freed = 0
        while freed < nbytes and self._spent:
            uuid, _ = self._spent.popitem(last=False)
            evicted.append(self.remove(uuid))
            freed += evicted[-1].nbytes
        return evicted

    def spent(self) -> int:
        return len(self._spent)

    # ------------------------------------------------------------------ inside

    def _claim(self, entry: HeldTensor, request_id: str) -> None:
        entry.claims[request_id[:_CLAIM_CHARS]] = None
        while len(entry.claims) > MAX_CLAIMS:
            del entry.claims[next(iter(entry.claims))]

    def _extend(self, uuid: str, entry: HeldTensor, until: float) -> None:
        if until > entry.expires_at:
            entry.expires_at = until
            self._timer(until, uuid)

    def _timer(self, when: float, uuid: str) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), uuid))

    def _review(self, uuid: str, now: float) -> None:
        entry = self.entries[uuid]
        if entry.pins or entry.claims or entry.promised_until > now:
            self._spent.pop(uuid, None)
        elif uuid not in self._spent:
            self._spent[uuid] = None

    def _compact(self) -> None:
        """Drop the stale timers (amortized: only when they outnumber the live ones twice over)."""
        live = [(e.expires_at, next(self._seq), u) for u, e in self.entries.items()]
        live += [(e.promised_until, next(self._seq), u) for u, e in self.entries.items() if e.promised_until]
        heapq.heapify(live)
        self._timers = live


_CLAIM_CHARS = 256  # a claim keeps this much of a request id (a release names at most as many)


def as_dict(entry: HeldTensor) -> dict[str, Any]:
    """What the worker side needs to load a held tensor (the step's metadata, glue.py)."""
    return {"path": str(entry.path), "dtype": entry.dtype, "rows": entry.rows, "width": entry.width}
