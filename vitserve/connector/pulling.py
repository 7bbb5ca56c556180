"""The connector's pull (docs/vllm.md, "Pull"; SPEC §13): an announced item that names a `producer` and is not
held is fetched from that producer (vitserve --llm_transport pull) rather than waited for. No vLLM here: glue.py
calls `Puller.step` with what admission.py found missing, after admission's checks passed (the announced rows
against the request's placeholder, the width against the model's, the dtype one of the wire's), so nothing is
fetched for a request that would fail anyway.

- A fetch goes only to a producer `pull_from` admits (allowlist.py), with the key when one is set (fetch.py); a
  refusal at once (not admitted, a bind address, too big) fails the request with the reason, no network.
- The fetched message is kept by the store through the same checks and bound as a push (store.py `accept`).
- An engine with nothing else to run waits in place for the fetches (`EngineSteps`, at most IDLE_WAIT_S), so
  the request is scheduled in the step that started them. Deferred instead, it would make vLLM step with nothing
  to run until they end, and vLLM's shared-memory queue busy-waits for a second after each step: on a host whose
  cores are all the worker's (vLLM's CPU platform) that wait takes a core from the request's own prefill.
- A fetch of this request that ended without keeping (the producer answered `missing`, did not answer within
  `wait_s`, was unreachable, or its tensor disagreed) fails the request: vLLM fails that request alone
  (take_unavailable_requests) and stays healthy. An earlier request's failure is not this one's: its fetch is
  started again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from vitserve.connector.admission import Announced
from vitserve.connector.allowlist import DEFAULT_PULL_FROM
from vitserve.connector.config import ConnectorConfig
from vitserve.connector.fetch import ENDINGS, Expect, FetchConfig, Fetcher
from vitserve.connector.store import EmbeddingStore

IDLE_WAIT_S = 1.0  # the longest an idle engine waits in place for one request's fetches (then: defer it)


class EngineSteps:
    """What vLLM's scheduler runs, as its connector sees it: the requests scheduled in an earlier step and not
    finished, and whether this step has work yet. Idle for a request: neither, besides that request. A request
    with no image or video never reaches the connector before it is scheduled, so one that arrives in the same
    step as a pulled request can wait with it, at most IDLE_WAIT_S."""

    def __init__(self) -> None:
        self._running: set[str] = set()
        self._step_has_work = False

    def stepped(self, scheduled: Iterable[str], finished: Iterable[str]) -> None:
        """A step was scheduled (build_connector_meta): these requests run in it, those have finished."""
        self._running.update(scheduled)
        self._running.difference_update(finished)
        self._step_has_work = False

    def finished(self, request_id: str) -> None:
        self._running.discard(request_id)

    def has_work(self) -> None:
        """This step has work now: a request was admitted, or one waited in place already."""
        self._step_has_work = True

    def idle_but(self, request_id: str) -> bool:
        return not self._step_has_work and self._running <= {request_id}


class Puller:
    """The fetcher of one engine core's connector (each data-parallel core has its own) and which fetches each
    request started."""

    def __init__(
        self, config: ConnectorConfig, key: bytes | None, store: EmbeddingStore, log: logging.Logger
    ) -> None:
        fetch = FetchConfig(
            pull_from=config.pull_from or DEFAULT_PULL_FROM, key=key, deadline_s=config.wait_s
        )
        self.fetcher = Fetcher(fetch, on_message=store.accept, log=log, area=store.area())
        self._started: dict[str, set[str]] = {}  # request id -> uuids fetched for it

    def step(
        self, request_id: str, missing: tuple[str, ...], announced: Mapping[str, Announced], left_s: float
    ) -> str | None:
        """Start or follow the fetches of a request's missing items; None: keep waiting (a fetch runs, or an
        item is pushed), else why the request fails."""
        started = self._started.setdefault(request_id, set())
        for uuid in missing:
            item = announced[uuid]
            if item.producer is None or self.fetcher.busy(uuid):
                continue
            outcome = self.fetcher.result(uuid)
            if uuid in started and outcome is not None and not outcome.kept:
                return f"item {uuid}: fetching it from producer {item.producer} failed: {outcome.reason}"
            expect = Expect(item.rows, item.width, item.dtype)
            refused = self.fetcher.start(uuid, item.producer, expect, deadline_s=max(left_s, 0.001))
            if refused is not None:
                return f"item {uuid}: producer {item.producer} refused: {refused.reason}"
            started.add(uuid)
        return None

    def wait(self, missing: Iterable[str], left_s: float) -> bool:
        """Wait in place while any of `missing` is being fetched: at most IDLE_WAIT_S or `left_s` of the
        request's wait_s. False at once when none is (a push awaited)."""
        return self.fetcher.wait_for(missing, max(min(left_s, IDLE_WAIT_S), 0.0))

    def forget(self, request_id: str) -> None:
        self._started.pop(request_id, None)

    def counters(self) -> dict[str, int]:
        """The fetcher's counters under counters.py's names: pull_started, pull_kept, pull_bytes, pull_ms,
        pull_late (answers dropped: late or unreadable), pull_failed_<reason> and the gauge pull_in_flight."""
        got = self.fetcher.counters()
        out = {f"pull_{name}": int(got[name]) for name in ("started", "kept", "bytes", "ms", "in_flight")}
        out["pull_late"] = int(got["late"] + got["unreadable"])
        out.update({f"pull_failed_{reason}": int(got[reason]) for reason in ENDINGS})
        return out

    def close(self) -> None:
        self.fetcher.close()
