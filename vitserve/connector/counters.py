"""The connector's counters as vLLM's stats carry them (pure; metrics.py is the vLLM side, docs/vllm.md "Metrics").

vLLM 0.32 asks the scheduler-side connector for its stats once per engine step (`get_ec_connector_stats`), ships
their `data` dict to its API server and hands it to the connector class's Prometheus metrics there. The data is
`{"counts": {name: increase since the last report}, "gauges": {name: value now}}`: plain ints, so it crosses
vLLM's msgpack; two reports merge by adding counts and keeping the later gauges.

The names: the store's counters (store.py `counters()`), the glue's own (`supplied`, `failed_<reason>`) and the
fetcher's (pulling.py `Puller.counters`: `pull_*`), each under `vllm:vitserve_connector_<name>`;
`refused_<reason>`, `failed_<reason>` and `pull_failed_<reason>` are one metric each with a `reason` label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "vllm:vitserve_connector_"
GAUGES = {
    "held_bytes": "Bytes of embeddings the connector holds now (received, not yet evicted or expired).",
    "held": "Embeddings the connector holds now.",
    "max_bytes": "The connector's bound in bytes: max_gb, or less when its shm_dir device has less room.",
    "pool_files": "Files kept for vitserve's next same-host write (recycled pages, on top of max_gb).",
    "pool_bytes": "Bytes of the files kept for vitserve's next same-host write (recycled pages, on top of max_gb).",
    "pull_in_flight": "Fetches from vitserve producers (pull) started and not ended.",
}
COUNTERS = {
    "received": "Embeddings received, checked and acknowledged.",
    "adopted": "Of those received, files vitserve wrote into the connector's shared memory (one host: one write).",
    "pooled": "Files of embeddings let go that were kept for vitserve's next same-host write instead of deleted.",
    "rejected": "Messages dropped unanswered: not vitserve's wire.",
    "handshakes_failed": "Peers whose ZMTP handshake failed: without the key, or not ZMQ; nothing of theirs read.",
    "evicted": "Held embeddings evicted to make room (loaded or expired ones only).",
    "expired": "Held embeddings dropped at their expiry.",
    "releases": "Held embeddings released early: vitserve said their request failed.",
    "receiver_restarts": "Times the receiver thread ended and was restarted.",
    "supplied": "Embeddings the connector handed to vLLM's encoder cache, checked against their request.",
    "pull_started": "Fetches from vitserve producers (pull) started, one per announced item not held.",
    "pull_kept": "Fetches that brought their embedding and kept it (also counted as received).",
    "pull_bytes": "Bytes of the embeddings fetches brought and kept.",
    "pull_ms": "Milliseconds the kept fetches took, each from its start to its embedding kept (/ pull_kept: the mean).",
    "pull_idle_waits": "Requests whose fetches an idle engine waited for in place (at most 1 s) instead of stepping empty.",
    "pull_late": "Answers to fetches dropped: late (the fetch had ended) or not the wire.",
}
LABELLED = {  # a prefix of counter names -> (its metric, documentation); the rest of the name is the reason
    "refused_": ("refused", "Messages refused with a nack, by reason; nothing of them kept."),
    "failed_": (
        "requests_failed",
        "Requests the connector failed (vLLM answers them with an error), by reason.",
    ),
    "pull_failed_": (
        "pull_failed",
        "Fetches that ended without the embedding, by reason: missing (the producer does not hold it), refused "
        "(not admitted by pull_from, too big, or the tensor refused), unreachable, timeout (wait_s), error.",
    ),
}
OTHER = "other"  # the reason of refusals the store counted without one


def snapshot(counters: Mapping[str, int | float], glue: Mapping[str, int]) -> dict[str, int]:
    """The store's counters and the glue's own, as one flat dict of ints."""
    return {**{k: int(v) for k, v in counters.items()}, **glue}


def delta(previous: Mapping[str, int], now: Mapping[str, int]) -> dict[str, Any]:
    """The stats data from one snapshot to the next ({} when nothing moved)."""
    counts = {}
    for name, value in now.items():
        if name in GAUGES or name == "refused":
            continue
        moved = value - previous.get(name, 0)
        if moved > 0:
            counts[name] = moved
    refused = now.get("refused", 0) - previous.get("refused", 0)
    reasons = sum(v for k, v in counts.items() if k.startswith("refused_"))
    if refused > reasons:  # a store that counts no reasons, or not all of them
        counts["refused_" + OTHER] = refused - reasons
    gauges = {name: now[name] for name in GAUGES if name in now}
    if not counts and all(previous.get(name) == value for name, value in gauges.items()):
        return {}
    return {"counts": counts, "gauges": gauges}


def merge(first: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, Any]:
    counts = dict(first.get("counts", {}))
    for name, value in later.get("counts", {}).items():
        counts[name] = counts.get(name, 0) + value
    return {"counts": counts, "gauges": {**first.get("gauges", {}), **later.get("gauges", {})}}


def metric(name: str) -> tuple[str, str | None]:
    """(the metric's name without PREFIX, its reason label or None) for a counter's name."""
    for prefix, (metric_name, _) in LABELLED.items():
        if name.startswith(prefix):
            return metric_name, name.removeprefix(prefix)
    return name, None


def flat(data: Mapping[str, Any]) -> dict[str, int]:
    """One line's worth for vLLM's periodic log ("EC Transfer metrics: ...")."""
    return {**data.get("counts", {}), **data.get("gauges", {})}
