"""The wire's pull messages (SPEC §13, docs/wire.md): the connector inside a vLLM engine fetches an embedding from
the vitserve replica that a chat request names, instead of vitserve pushing it first.

    connector -> vitserve   {"v": 3, "fetch": uuid, "query_id": str}
                            (+ "incoming", "token_file", "token": where the connector takes same-host files)
    vitserve -> connector   the embedding message of that uuid (rpc/wire.py encode_embedding_message, its
                            header's `uuid` the one asked for and its `message_id` the query's id)
                            or, on the connector's host, a file message (rpc/handoff.py encode_file: vitserve
                            wrote the tensor into `incoming`, as a same-host push does; its `message_id` the
                            query's id)
                            or {"v": 3, "missing": uuid, "query_id": str, "reason": str}

One uuid per query: each has its own deadline, its own bytes and its own answer, and a DEALER pipelines many
queries at no extra cost. The answer's `message_id` is the query's id, so a late answer to a query the
connector gave up on is told from a fresh one.

A query may name the connector's incoming area (its same-host hello's answer, rpc/handoff.py Info). A producer
that reads `token` at `token_file` sees that very directory (same host, same /dev/shm) and answers with a file
there instead of the bytes: one write, no copy through loopback TCP (and none through CURVE with a key). A
producer that does not, or an older one, sends the bytes; an older connector names no area and gets the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vitserve.rpc import wire
from vitserve.rpc.handoff import FileEmbedding, decode_handoff
from vitserve.rpc.replies import versioned
from vitserve.rpc.wire import WIRE_VERSION, ImageEmbedding, WireError, decode_embedding_message

MAX_REASON_CHARS = 1024
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class Area:
    """The connector's incoming area, as a query names it (rpc/handoff.py Info's fields of the same names)."""

    incoming: str
    token_file: str
    token: str


@dataclass(frozen=True)
class Fetch:
    query_id: str  # the answer's message_id (or its `query_id` when missing)
    uuid: str  # the encoder-cache key asked for
    area: Area | None = None  # where a producer on the connector's host may write the answer as a file


@dataclass(frozen=True)
class Missing:
    query_id: str
    uuid: str
    reason: str  # why the producer does not send it (not held, expired, released)


def encode_fetch(uuid: str, query_id: str, area: Area | None = None) -> bytes:
    query: dict[str, Any] = {"v": WIRE_VERSION, "fetch": uuid, "query_id": query_id}
    if area is not None:
        query.update(incoming=area.incoming, token_file=area.token_file, token=area.token)
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
    area = Area(query["incoming"], query["token_file"], query["token"]) if "incoming" in query else None
    return Fetch(query["query_id"], query["fetch"], area)


def decode_answer(frames: Sequence[Any]) -> ImageEmbedding | FileEmbedding | Missing:
    """What a producer sends back: a `missing` answer or a file message (one frame each), or an embedding
    message. WireError for anything else."""
    if len(frames) == 1:
        answer = versioned(frames[0])
        if "file" in answer:
            file = decode_handoff(frames)
            if not isinstance(file, FileEmbedding):  # {"hello", "file"}: a hello
                raise WireError("an answer with `file` is a file message, not a hello")
            return file
        if "missing" not in answer:
            raise WireError(f"a one-frame answer is `missing`; got the keys {sorted(answer)[:8]}")
        reason = answer.get("reason")
        if not isinstance(reason, str):
            raise WireError(f"a missing answer's reason must be a string, got {wire._kind(reason)}")
        _check_fetch({"fetch": answer["missing"], "query_id": answer.get("query_id")})
        return Missing(answer["query_id"], answer["missing"], reason[:MAX_REASON_CHARS])
    return decode_embedding_message(frames)


def _check_fetch(query: dict[str, Any]) -> None:
    if "incoming" in query and not all(
        isinstance(query.get(k), str) and 0 < len(query[k]) <= MAX_PATH_CHARS
        for k in ("incoming", "token_file", "token")
    ):
        raise WireError(f"a fetch's incoming, token_file and token are strings of 1-{MAX_PATH_CHARS} chars")
    if not wire._is_id(query.get("query_id")):
        raise WireError(f"query_id must be a string of 1-{wire.MAX_ID_CHARS} chars")
    if not wire.is_cache_key(query.get("fetch")):
        raise WireError(
            f"a fetch names one uuid (an encoder-cache key), got {wire._kind(query.get('fetch'))}"
        )
