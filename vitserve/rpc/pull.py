"""The wire's pull messages (SPEC §13, docs/wire.md): the connector inside a vLLM engine fetches an embedding from
the vitserve replica that a chat request names, instead of vitserve pushing it first.

    connector -> vitserve   {"v": 3, "fetch": uuid, "query_id": str}
    vitserve -> connector   the embedding message of that uuid (rpc/wire.py encode_embedding_message, its
                            header's `uuid` the one asked for and its `message_id` the query's id)
                            or {"v": 3, "missing": uuid, "query_id": str, "reason": str}

One uuid per query: each has its own deadline, its own bytes and its own answer, and a DEALER pipelines many
queries at no extra cost. The answer's `message_id` is the query's id, so a late answer to a query the
connector gave up on is told from a fresh one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vitserve.rpc import wire
from vitserve.rpc.replies import versioned
from vitserve.rpc.wire import WIRE_VERSION, ImageEmbedding, WireError, decode_embedding_message

MAX_REASON_CHARS = 1024


@dataclass(frozen=True)
class Fetch:
    query_id: str  # the answer's message_id (or its `query_id` when missing)
    uuid: str  # the encoder-cache key asked for


@dataclass(frozen=True)
class Missing:
    query_id: str
    uuid: str
    reason: str  # why the producer does not send it (not held, expired, released)


def encode_fetch(uuid: str, query_id: str) -> bytes:
    query = {"v": WIRE_VERSION, "fetch": uuid, "query_id": query_id}
    _check_fetch(query)  # the sender refuses what the producer would reject
    return wire._pack(query)


def encode_missing(uuid: str, query_id: str, reason: str) -> bytes:
    answer = {"v": WIRE_VERSION, "missing": uuid, "query_id": query_id, "reason": reason[:MAX_REASON_CHARS]}
    return wire._pack(answer)


def decode_fetch(frames: Sequence[Any]) -> Fetch:
    """What a connector sends a producer: one frame, a fetch query. WireError for anything else."""
    if len(frames) != 1:
        raise WireError(f"a fetch query is one frame, got {len(frames)}")
    query = versioned(frames[0])
    _check_fetch(query)
    return Fetch(query["query_id"], query["fetch"])


def decode_answer(frames: Sequence[Any]) -> ImageEmbedding | Missing:
    """What a producer sends back: a `missing` answer (one frame) or an embedding message. WireError for
    anything else."""
    if len(frames) == 1:
        answer = versioned(frames[0])
        if "missing" not in answer:
            raise WireError(f"a one-frame answer is `missing`; got the keys {sorted(answer)[:8]}")
        reason = answer.get("reason")
        if not isinstance(reason, str):
            raise WireError(f"a missing answer's reason must be a string, got {wire._kind(reason)}")
        _check_fetch({"fetch": answer["missing"], "query_id": answer.get("query_id")})
        return Missing(answer["query_id"], answer["missing"], reason[:MAX_REASON_CHARS])
    return decode_embedding_message(frames)


def _check_fetch(query: dict[str, Any]) -> None:
    if not wire._is_id(query.get("query_id")):
        raise WireError(f"query_id must be a string of 1-{wire.MAX_ID_CHARS} chars")
    if not wire.is_cache_key(query.get("fetch")):
        raise WireError(
            f"a fetch names one uuid (an encoder-cache key), got {wire._kind(query.get('fetch'))}"
        )
