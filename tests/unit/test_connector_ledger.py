"""The connector's bookkeeping (vitserve/connector/ledger.py) on plain objects: claims, pins, promises, expiry and
eviction order, and the running byte total."""

from __future__ import annotations

from pathlib import Path

from vitserve.connector.ledger import MAX_CLAIMS, HeldTensor, Ledger

T = 1000.0  # "now" in these tests


def entry(nbytes: int = 10, expires_at: float = T + 100) -> HeldTensor:
    return HeldTensor(Path("x"), "float32", 1, 1, nbytes, expires_at)


def test_a_push_claims_until_a_load_and_the_oldest_spent_goes_first():
    ledger = Ledger(30)
    for uuid in "abc":
        ledger.add(uuid, entry(), f"push-{uuid}", T)
    assert ledger.held_bytes == 30
    assert ledger.make_room(10, T)[0] is False  # all claimed: nothing may go
    for uuid in "ba":  # loaded in this order: b is spent first
        ledger.pin(uuid, "vllm", T)
        ledger.unpin(uuid, "vllm", T + 10, T)
    fits, expired, evicted = ledger.make_room(10, T)
    assert fits
    assert expired == []
    assert len(evicted) == 1
    assert "b" not in ledger.entries
    assert "a" in ledger.entries
    assert ledger.held_bytes == 20


def test_two_pushes_need_two_loads_or_a_release():
    ledger = Ledger(100)
    ledger.add("a", entry(), "r1", T)
    ledger.renew("a", "r2", T + 50, T)
    ledger.pin("a", "v1", T)
    ledger.unpin("a", "v1", T, T)
    assert ledger.spent() == 0
    ledger.release("a", "r9", T)  # not a claim of it
    assert ledger.spent() == 0
    ledger.release("a", "r2", T)
    assert ledger.spent() == 1
    assert ledger.entries["a"].loaded


def test_an_unpin_without_a_pin_consumes_no_claim():
    ledger = Ledger(100)
    ledger.add("a", entry(), "r1", T)
    ledger.unpin("a", "never-pinned", T, T)
    assert ledger.entries["a"].claims == {"r1": None}


def test_claims_are_bounded_and_keep_the_newest():
    ledger = Ledger(100)
    ledger.add("a", entry(), "r0", T)
    for i in range(1, 200):
        ledger.renew("a", f"r{i}", T + 1, T)
    assert len(ledger.entries["a"].claims) == MAX_CLAIMS
    assert "r199" in ledger.entries["a"].claims
    assert "r0" not in ledger.entries["a"].claims


def test_a_promise_outlives_a_load_until_its_time():
    ledger = Ledger(100)
    ledger.add("a", entry(), "r1", T)
    assert ledger.promise("a", T + 30, T)
    assert not ledger.promise("nothing", T + 30, T)
    ledger.pin("a", "v", T)
    ledger.unpin("a", "v", T, T)
    assert ledger.spent() == 0
    assert ledger.expire(T + 29) == []
    assert ledger.spent() == 0
    assert ledger.expire(T + 30) == []  # the promise's end: spent, not expired
    assert ledger.spent() == 1


def test_expiry_spares_a_pinned_entry_until_it_is_unpinned():
    ledger = Ledger(100)
    ledger.add("a", entry(expires_at=T + 1), "r", T)
    ledger.add("b", entry(expires_at=T + 1), "r", T)
    ledger.pin("b", "v", T)
    assert [e.expires_at for e in ledger.expire(T + 2)] == [T + 1]
    assert list(ledger.entries) == ["b"]
    ledger.unpin("b", "v", T + 1, T + 3)
    assert len(ledger.expire(T + 3)) == 1
    assert ledger.entries == {}
    assert ledger.held_bytes == 0


def test_stale_timers_are_compacted_and_expiry_still_holds():
    ledger = Ledger(100)
    ledger.add("a", entry(expires_at=T + 1), "r", T)
    for i in range(5000):
        ledger.touch("a", T + 2 + i)
    ledger.expire(T)
    assert len(ledger._timers) < 5000  # noqa: SLF001  # the heap's size is what is checked
    assert ledger.expire(T + 5000) == []
    assert len(ledger.expire(T + 5002)) == 1


def test_remove_keeps_the_total_and_the_spent_set_true():
    ledger = Ledger(100)
    ledger.add("a", entry(25), "r", T)
    ledger.release("a", "r", T)
    assert ledger.spent() == 1
    ledger.remove("a")
    assert (ledger.held_bytes, ledger.spent()) == (0, 0)
    assert ledger.evict(100) == []
