"""The FIFO token-budget scheduler (docs/design.md invariants 2 and 3), on plain ids: examples, then a
hypothesis state machine that checks every operation against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.profiles import examples
from vitserve.engine.scheduler import Scheduler


def drain(s: Scheduler) -> list[list]:
    batches = []
    while (b := s.next_batch()) is not None:
        batches.append(b)
    return batches


def test_empty_queue_has_no_batch():
    assert Scheduler(10, 4).next_batch() is None


def test_packs_from_head_and_stops_at_first_misfit_which_stays_first():
    s = Scheduler(budget_tokens=10, max_batch_images=8)
    for name, tokens in [("a", 4), ("b", 4), ("c", 5), ("d", 1)]:
        s.add(name, tokens)
    # "c" does not fit after a+b; "d" would, but strict FIFO never skips ahead to it.
    assert s.next_batch() == ["a", "b"]
    assert s.next_batch() == ["c", "d"]
    assert s.next_batch() is None


def test_item_over_budget_is_admitted_alone_never_spins():
    # TEI #723: an entry larger than the budget pushed back forever. Here it goes out alone.
    s = Scheduler(budget_tokens=10, max_batch_images=8)
    s.add("small", 3)
    s.add("huge", 50)
    s.add("tail", 3)
    assert drain(s) == [["small"], ["huge"], ["tail"]]


def test_budget_zero_is_unlimited_but_image_cap_holds():
    s = Scheduler(budget_tokens=0, max_batch_images=2)
    for i in range(5):
        s.add(i, 10**9)
    assert drain(s) == [[0, 1], [2, 3], [4]]


def test_exact_fill_is_one_batch():
    s = Scheduler(budget_tokens=12, max_batch_images=8)
    for i, t in enumerate([4, 4, 4, 1]):
        s.add(i, t)
    assert drain(s) == [[0, 1, 2], [3]]


def test_cancel_skips_without_reordering_and_updates_accounting():
    s = Scheduler(budget_tokens=100, max_batch_images=2)
    for name in "abcd":
        s.add(name, 10)
    assert s.cancel("b") is True
    assert s.cancel("b") is False
    assert s.cancel("zz") is False
    assert (s.queued_items, s.queued_tokens, len(s)) == (3, 30, 3)
    assert drain(s) == [["a", "c"], ["d"]]
    assert (s.queued_items, s.queued_tokens) == (0, 0)
    assert s.cancel("a") is False  # already batched


def test_cancelled_then_readded_id_goes_to_the_tail():
    s = Scheduler(budget_tokens=0, max_batch_images=10)
    s.add("a", 1)
    s.add("b", 1)
    s.cancel("a")
    s.add("a", 2)
    assert s.queued_tokens == 3
    assert drain(s) == [["b", "a"]]


def test_all_cancelled_gives_none():
    s = Scheduler(budget_tokens=5, max_batch_images=3)
    s.add(1, 1)
    s.add(2, 1)
    s.cancel(1)
    s.cancel(2)
    assert s.next_batch() is None
    assert len(s) == 0


@pytest.mark.parametrize(("budget", "cap"), [(-1, 1), (10, 0)])
def test_rejects_bad_limits(budget, cap):
    with pytest.raises(ValueError, match="must be >="):
        Scheduler(budget, cap)


def test_rejects_duplicate_live_id_and_negative_tokens():
    s = Scheduler(10, 2)
    s.add("a", 1)
    with pytest.raises(ValueError, match="already queued"):
        s.add("a", 1)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        s.add("b", -1)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / cancel / re-add / next_batch sequences against a list model of the queue."""

    @initialize(budget=st.integers(0, 40), cap=st.integers(1, 6))
    def init(self, budget, cap):
        self.s = Scheduler(budget, cap)
        self.budget, self.cap = budget, cap
        self.model: list[tuple[object, int]] = []  # live queue, arrival order
        self.next_id = 0
        self.cancelled: list[object] = []  # ids currently cancelled (may be re-added)
        self.adds: list[list] = []  # [id, cancelled?] per add, in order (an id repeats after a re-add)
        self.batched: list[object] = []

    @rule(tokens=st.integers(0, 60))
    def add(self, tokens):
        item = f"i{self.next_id}"
        self.next_id += 1
        self._add(item, tokens)

    @precondition(lambda self: self.cancelled)
    @rule(data=st.data(), tokens=st.integers(0, 60))
    def readd_cancelled(self, data, tokens):
        item = data.draw(st.sampled_from(self.cancelled))
        self.cancelled.remove(item)
        self._add(item, tokens)

    def _add(self, item, tokens):
        self.s.add(item, tokens)
        self.model.append((item, tokens))
        self.adds.append([item, False])

    @rule(data=st.data())
    def cancel(self, data):
        known = [i for i, _ in self.model] + self.batched + self.cancelled + ["never-added"]
        item = data.draw(st.sampled_from(known))
        live = [i for i, _ in self.model]
        assert self.s.cancel(item) is (item in live)
        if item in live:
            self.model = [(i, t) for i, t in self.model if i != item]
            self.cancelled.append(item)
            live_add = next(a for a in reversed(self.adds) if a[0] == item)
            live_add[1] = True

    @rule()
    def next_batch(self):
        batch = self.s.next_batch()
        if not self.model:
            assert batch is None
            return
        assert batch, "a non-empty queue always yields a batch (no spinning)"
        tokens = dict(self.model)
        assert batch[0] == self.model[0][0], "the head is always admitted first"
        assert batch == [i for i, _ in self.model[: len(batch)]], "strict FIFO from the head"
        assert len(batch) <= self.cap
        total = sum(tokens[i] for i in batch)
        if self.budget and len(batch) > 1:
            assert total <= self.budget
        rest = self.model[len(batch) :]
        if rest and len(batch) < self.cap and self.budget:
            assert total + rest[0][1] > self.budget, "stopped although the next item fitted"
        if rest and not self.budget:
            assert len(batch) == self.cap, "unlimited budget stops only at the image cap"
        self.model = rest
        self.batched.extend(batch)

    @invariant()
    def accounting(self):
        assert self.s.queued_items == len(self.s) == len(self.model)
        assert self.s.queued_tokens == sum(t for _, t in self.model)

    def teardown(self):
        # No starvation: draining returns every live item, and all batches together are the
        # insertion order with the cancelled adds removed.
        for _ in range(len(self.model) + 1):
            self.next_batch()
        assert self.s.next_batch() is None
        assert self.batched == [item for item, cancelled in self.adds if not cancelled]


SchedulerMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=60, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
