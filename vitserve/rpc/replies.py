"""The wire's messages for vitserve's vLLM connector (docs/wire.md, "vitserve's vLLM connector"), beside the
embedding message and its acknowledgement (rpc/wire.py, whose header reader and checks these reuse):

    connector -> vitserve   {"v": 3, "ack": message_id}                      kept whole and checked
                            {"v": 3, "nack": message_id, "reason": str}      refused: it keeps nothing of it
                            {"v": 3, "held": [uuid, ...], "query_id": str}   the answer to a holds query
    vitserve -> connector   {"v": 3, "holds": [uuid, ...], "query_id": str, "expires_at": float (optional)}
                            {"v": 3, "release": [uuid, ...], "request_id": str}   no answer

Each is one msgpack frame. A holds query asks which of these uuids the connector holds; each held one is
kept at least until `expires_at` (Unix time; the connector's default when absent, never past its
`max_hold_s`), so the request naming it can follow without pushing it again. A release says that request
`request_id` (the embedding messages' `request_id`) will not load these uuids (it failed): the connector drops
that request's claim on each, and an entry nobody claims, pins or was promised becomes evictable at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vitserve.rpc import wire
from vitserve.rpc.wire import WIRE_VERSION, ImageEmbedding, WireError, decode_embedding_message

MAX_HOLDS = 1024  # uuids in one holds query (a request's images and videos, with room to spare)
MAX_REASON_CHARS = 1024


@dataclass(frozen=True)
class Ack:
    message_id: str


@dataclass(frozen=True)
class Nack:
    message_id: str
    reason: str  # why the connector refused it; it kept nothing of the message


@dataclass(frozen=True)
class Held:
    query_id: str
    uuids: tuple[str, ...]  # those of the query's uuids the connector holds (and keeps a while longer)


@dataclass(frozen=True)
class HoldsQuery:
    query_id: str
    uuids: tuple[str, ...]
    expires_at: (
        float | None
    )  # keep what is held at least until then (Unix time); None: the connector's default


@dataclass(frozen=True)
class Release:
    request_id: str  # the request (the embedding messages' request_id) that will not load these
    uuids: tuple[str, ...]


def encode_release(request_id: str, uuids: Sequence[str]) -> bytes:
    release = {"v": WIRE_VERSION, "release": list(uuids), "request_id": request_id}
    _check_release(release)  # the sender refuses what the connector would reject
    return wire._pack(release)


def encode_nack(message_id: str, reason: str) -> bytes:
    return wire._pack({"v": WIRE_VERSION, "nack": message_id, "reason": reason[:MAX_REASON_CHARS]})


def encode_holds(uuids: Sequence[str], query_id: str, expires_at: float | None = None) -> bytes:
    query: dict[str, Any] = {"v": WIRE_VERSION, "holds": list(uuids), "query_id": query_id}
    if expires_at is not None:
        query["expires_at"] = float(expires_at)
    _check_holds(query)  # the sender refuses what the connector would reject
    return wire._pack(query)


def encode_held(uuids: Sequence[str], query_id: str) -> bytes:
    return wire._pack({"v": WIRE_VERSION, "held": list(uuids), "query_id": query_id})


def decode_reply(frame: Any) -> Ack | Nack | Held:
    """What a receiver or the connector sent back; WireError for anything else."""
    reply = versioned(frame)
    if "ack" in reply:
        return Ack(_id(reply, "ack"))
    if "nack" in reply:
        reason = reply.get("reason")
        if not isinstance(reason, str):
            raise WireError(f"a refusal's reason must be a string, got {wire._kind(reason)}")
        return Nack(_id(reply, "nack"), reason[:MAX_REASON_CHARS])
    if "held" in reply:
        return Held(_id(reply, "query_id"), _uuids(reply, "held"))
    raise WireError(f"a reply is an ack, a nack or a held answer; got the keys {sorted(reply)[:8]}")


def decode_inbound(frames: Sequence[Any]) -> ImageEmbedding | HoldsQuery | Release:
    """What vitserve sends the connector: a holds query (one frame with `holds`), a release (one frame with
    `release`), or an embedding message (rpc/wire.py decode_embedding_message). WireError for anything else."""
    if len(frames) == 1:
        query = versioned(frames[0])
        if "holds" in query:
            _check_holds(query)
            return HoldsQuery(query["query_id"], tuple(query["holds"]), query.get("expires_at"))
        if "release" in query:
            _check_release(query)
            return Release(query["request_id"], tuple(query["release"]))
    return decode_embedding_message(frames)


def message_id_of(frames: Sequence[Any]) -> str | None:
    """The message id a malformed embedding message names, if its header says one: the connector refuses it by
    that id, so its sender learns at once instead of at its deadline. None when there is none to read."""
    try:
        header = wire._parse_header(wire._buffer(frames[0]))
    except (WireError, IndexError):
        return None
    message_id = header.get("message_id")
    return message_id if wire._is_id(message_id) else None


def versioned(frame: Any) -> dict[str, Any]:
    """One msgpack frame of the wire's current version, as a dict (WireError otherwise)."""
    message = wire._parse_header(wire._buffer(frame))
    version = message.get("v")
    if version != WIRE_VERSION or type(version) is not int:
        raise WireError(f"unknown wire version {wire._kind(version)}; this end speaks v{WIRE_VERSION}")
    return message


def _check_holds(query: dict[str, Any]) -> None:
    _id(query, "query_id")
    _uuids(query, "holds")
    expires_at = query.get("expires_at")
    if expires_at is not None and (type(expires_at) is not float or not math.isfinite(expires_at)):
        raise WireError(f"expires_at must be a finite float (Unix time), got {wire._kind(expires_at)}")


def _check_release(release: dict[str, Any]) -> None:
    _uuids(release, "release")
    if not isinstance(release.get("request_id"), str) or len(release["request_id"]) > wire.MAX_ID_CHARS:
        raise WireError(
            f"request_id must be a string of at most {wire.MAX_ID_CHARS} chars, got {wire._kind(release.get('request_id'))}"
        )


def _id(message: dict[str, Any], name: str) -> str:
    value = message.get(name)
    if not wire._is_id(value):
        raise WireError(f"{name} must be a string of 1-{wire.MAX_ID_CHARS} chars, got {wire._kind(value)}")
    return str(value)


def _uuids(message: dict[str, Any], name: str) -> tuple[str, ...]:
    value = message.get(name)
    if not isinstance(value, list) or len(value) > MAX_HOLDS or not all(map(wire.is_cache_key, value)):
        raise WireError(f"{name} must be a list of at most {MAX_HOLDS} uuids, got {wire._kind(value)}")
    return tuple(value)
