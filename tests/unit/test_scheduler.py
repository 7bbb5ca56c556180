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
    s = Scheduler(visual_batch_max_tokens=10, visual_infer_batch_size=8)
    for name, tokens in [("a", 4), ("b", 4), ("c", 5), ("d", 1)]:
        s.add(name, tokens)
    # "c" does not fit after a+b; "d" would, but strict FIFO never skips ahead to it.
    assert s.next_batch() == ["a", "b"]
    assert s.next_batch() == ["c", "d"]
    assert s.next_batch() is None


def test_item_over_budget_is_admitted_alone_never_spins():
    # TEI #723: an entry larger than the budget pushed back forever. Here it goes out alone.
    s = Scheduler(visual_batch_max_tokens=10, visual_infer_batch_size=8)
    s.add("small", 3)
    s.add("huge", 50)
    s.add("tail", 3)
    assert drain(s) == [["small"], ["huge"], ["tail"]]


def test_budget_zero_is_unlimited_but_image_cap_holds():
    s = Scheduler(visual_batch_max_tokens=0, visual_infer_batch_size=2)
    for i in range(5):
        s.add(i, 10**9)
    assert drain(s) == [[0, 1], [2, 3], [4]]


def test_exact_fill_is_one_batch():
    s = Scheduler(visual_batch_max_tokens=12, visual_infer_batch_size=8)
    for i, t in enumerate([4, 4, 4, 1]):
        s.add(i, t)
    assert drain(s) == [[0, 1, 2], [3]]


def test_cancel_skips_without_reordering_and_updates_accounting():
    s = Scheduler(visual_batch_max_tokens=100, visual_infer_batch_size=2)
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
    s = Scheduler(visual_batch_max_tokens=0, visual_infer_batch_size=10)
    s.add("a", 1)
    s.add("b", 1)
    s.cancel("a")
    s.add("a", 2)
    assert s.queued_tokens == 3
    assert drain(s) == [["b", "a"]]


def test_all_cancelled_gives_none():
    s = Scheduler(visual_batch_max_tokens=5, visual_infer_batch_size=3)
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
    """Random add / add_stream / cancel / re-add / next_batch sequences against a list model of the queue.

    Streams (a video's temporal groups) are modelled by the fairness rule itself: each keeps the longest
    prefix of its waiting items that fits one batch (budget and cap; at least one item) in the queue, and
    refills in stream order after every batch and cancel."""

    @initialize(budget=st.integers(0, 40), cap=st.integers(1, 6))
    def init(self, budget, cap):
        self.s = Scheduler(budget, cap)
        self.budget, self.cap = budget, cap
        self.model: list[tuple[object, int]] = []  # live queue, arrival order
        self.next_id = 0
        self.cancelled: list[object] = []  # ids currently cancelled (may be re-added)
        self.entered: list[list] = []  # [id, cancelled?] per entry into the queue, in order
        self.batched: list[object] = []
        self.streams: list[dict] = []  # {"waiting": [(id, tokens)], "queued": {id: tokens}}, in stream order

    @rule(tokens=st.integers(0, 60))
    def add(self, tokens):
        item = f"i{self.next_id}"
        self.next_id += 1
        self._add(item, tokens)

    @rule(tokens=st.lists(st.integers(0, 30), min_size=1, max_size=12))
    def add_stream(self, tokens):
        items = [(f"v{self.next_id}g{g}", t) for g, t in enumerate(tokens)]
        self.next_id += 1
        self.s.add_stream(items)
        self.streams.append({"waiting": list(items), "queued": {}})
        self._refill()

    @precondition(lambda self: self.cancelled)
    @rule(data=st.data(), tokens=st.integers(0, 60))
    def readd_cancelled(self, data, tokens):
        item = data.draw(st.sampled_from(self.cancelled))
        self.cancelled.remove(item)
        self._add(item, tokens)

    def _add(self, item, tokens):
        self.s.add(item, tokens)
        self._enter(item, tokens)

    def _enter(self, item, tokens):
        self.model.append((item, tokens))
        self.entered.append([item, False])

    def _refill(self):
        for stream in self.streams:
            while stream["waiting"]:
                item, tokens = stream["waiting"][0]
                queued = stream["queued"]
                full = len(queued) >= self.cap or (
                    self.budget and sum(queued.values()) + tokens > self.budget
                )
                if queued and full:
                    break
                stream["waiting"].pop(0)
                queued[item] = tokens
                self._enter(item, tokens)
        self.streams = [st_ for st_ in self.streams if st_["waiting"] or st_["queued"]]

    def _leave(self, item):
        for stream in self.streams:
            stream["queued"].pop(item, None)

    @rule(data=st.data())
    def cancel(self, data):
        waiting = [i for stream in self.streams for i, _ in stream["waiting"]]
        known = [i for i, _ in self.model] + waiting + self.batched + self.cancelled + ["never-added"]
        item = data.draw(st.sampled_from(known))
        live = [i for i, _ in self.model]
        assert self.s.cancel(item) is (item in live or item in waiting)
        if item in live:
            self.model = [(i, t) for i, t in self.model if i != item]
            next(e for e in reversed(self.entered) if e[0] == item)[1] = True
            self._leave(item)
            self._refill()
        elif item in waiting:
            for stream in self.streams:
                stream["waiting"] = [(i, t) for i, t in stream["waiting"] if i != item]
            self._refill()  # the groups behind it may fit now
        if item in live or item in waiting:
            self.cancelled.append(item)

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
        for item in batch:
            self._leave(item)
        self._refill()

    @invariant()
    def accounting(self):
        waiting = [(i, t) for stream in self.streams for i, t in stream["waiting"]]
        assert self.s.queued_items == len(self.s) == len(self.model) + len(waiting)
        assert self.s.queued_tokens == sum(t for _, t in self.model) + sum(t for _, t in waiting)

    @invariant()
    def a_stream_holds_at_most_one_batch_in_the_queue(self):
        queued = {i for i, _ in self.model}
        for stream in self.streams:
            window = [i for i in stream["queued"] if i in queued]
            assert len(window) == len(stream["queued"])
            if stream["waiting"]:
                assert window, "a stream with groups left always has one queued (no stall)"
            assert len(window) <= self.cap
            if self.budget and len(window) > 1:
                assert sum(stream["queued"].values()) <= self.budget

    def teardown(self):
        # No starvation: draining returns every live item, streams included, and all batches together are
        # the order items entered the queue with the cancelled ones removed.
        waiting = sum(len(stream["waiting"]) for stream in self.streams)
        for _ in range(len(self.model) + waiting + 1):
            self.next_batch()
        assert self.s.next_batch() is None
        assert not self.streams
        assert len(self.s) == 0
        assert self.batched == [item for item, cancelled in self.entered if not cancelled]


def test_a_long_video_keeps_one_batch_queued_so_an_image_behind_it_waits_one_batch():
    s = Scheduler(visual_batch_max_tokens=10, visual_infer_batch_size=8)
    s.add_stream([(f"g{k}", 4) for k in range(10)])  # 40 tokens: 2 groups per batch
    s.add("image", 3)
    assert (s.queued_items, s.queued_tokens) == (11, 43)
    assert s.next_batch() == ["g0", "g1"]  # the image was queued behind the video's first batch only
    assert s.next_batch() == ["image", "g2"]  # g2 and g3 entered behind the image
    assert drain(s) == [["g3", "g4"], ["g5", "g6"], ["g7", "g8"], ["g9"]]
    assert s.queued_items == s.queued_tokens == 0


def test_cancelling_a_streams_queued_and_waiting_items():
    s = Scheduler(visual_batch_max_tokens=0, visual_infer_batch_size=2)
    s.add_stream([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    assert s.cancel("c")  # waiting
    assert "c" not in s
    assert s.cancel("a")  # queued: b stays, the next waiting one (d) enters
    assert s.queued_items == 2
    assert drain(s) == [["b", "d"]]
    with pytest.raises(ValueError, match="already queued"):
        s.add_stream([("x", 1), ("x", 1)])


SchedulerMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=60, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_cancelling_a_waiting_group_that_did_not_fit_lets_the_groups_behind_it_enter_at_once():
    s = Scheduler(visual_batch_max_tokens=10, visual_infer_batch_size=8)
    s.add_stream([("a", 6), ("b", 6), ("c", 1)])  # b does not fit beside a: b and c wait
    s.add("image", 1)
    assert s.cancel("b")
    assert s.next_batch() == ["a", "image", "c"]  # c entered when b left, behind the image
    assert s.next_batch() is None
