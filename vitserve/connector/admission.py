"""Which tensors vitserve's vLLM connector may hand vLLM for one request: pure decisions, no vLLM, no I/O
(glue.py turns a vLLM request into `Item`s and calls these; tests/unit/test_connector_admission.py tests them).

vitserve names the items it pushed in the chat request's body field `ec_transfer_params` (docs/wire.md,
"The announcement"); vLLM 0.32 carries that field to `request.ec_transfer_params`:

    {"vitserve": {"v": 1, "items": {"<uuid>": {"rows": N, "width": W, "dtype": "bfloat16"}}}}

It reaches the connector from a request, so its shape is checked rather than assumed: anything malformed fails
that request with a reason (AnnouncementError), never the scheduler. Unknown keys are ignored (a later version
adds some). An item is supplied from the connector only when it is announced, and the tensor held for it agrees
with the announcement (rows, width, dtype), with the rows the request's placeholder needs and with the model's
width. Everything else is vLLM's own to encode (an item with pixels) or fails the request (an item without
pixels: nothing else can give vLLM its tensor, and vLLM's encoder would fail its engine on it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

NAMESPACE = "vitserve"  # the key of ec_transfer_params that is vitserve's
VERSION = 1
MAX_ITEMS = 4096  # items in one announcement; vLLM's --limit-mm-per-prompt is far below
MAX_UUID_CHARS = 1024


class AnnouncementError(ValueError):
    """A malformed announcement: the request that carries it fails with this reason."""


@dataclass(frozen=True)
class Announced:
    """What vitserve says it pushed for one uuid."""

    rows: int
    width: int
    dtype: str
    producer: str | None = None  # a pull: where to fetch it (vitserve --pull_advertise); None: pushed


@dataclass(frozen=True)
class Item:
    """One multimodal item of a request, as the connector sees it."""

    uuid: str  # vLLM's identifier: its encoder-cache key
    rows: int  # the embeddings the request's placeholder needs (vLLM's get_num_encoder_embeds)
    has_content: bool  # it carries what vLLM's encoder needs (pixels, or a processor-cache address)
    done: bool = False  # its tokens are in the KV cache already: nothing to load


class HeldShape(Protocol):
    """What the store holds for a uuid (store.py's HeldTensor)."""

    @property
    def rows(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class Verdict:
    """For one request: the uuids checked and to be loaded by the connector, those announced and not here yet,
    and why the request must fail (None: it need not)."""

    supply: frozenset[str] = frozenset()
    missing: tuple[str, ...] = ()
    failure: str | None = None
    reason: str | None = None  # the failure's kind, a metric label: "unannounced" or "mismatch"


def parse_announcement(params: object, dtypes: Collection[str]) -> dict[str, Announced]:
    """vitserve's items in a request's ec_transfer_params ({} when it names none); AnnouncementError if
    malformed."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise AnnouncementError(f"ec_transfer_params must be an object, not {type(params).__name__}")
    ours = params.get(NAMESPACE)
    if ours is None:
        return {}
    if not isinstance(ours, Mapping):
        raise AnnouncementError(f"ec_transfer_params.{NAMESPACE} must be an object")
    version = ours.get("v")
    if not _is_int(version) or version != VERSION:
        raise AnnouncementError(
            f"ec_transfer_params.{NAMESPACE}.v is {version!r}; this connector reads {VERSION}"
        )
    items = ours.get("items")
    if not isinstance(items, Mapping):
        raise AnnouncementError(f"ec_transfer_params.{NAMESPACE}.items must be an object of uuid -> item")
    if len(items) > MAX_ITEMS:
        raise AnnouncementError(f"{len(items)} items announced; at most {MAX_ITEMS}")
    return {_uuid(uuid): _announced(uuid, item, dtypes) for uuid, item in items.items()}


def _uuid(uuid: object) -> str:
    if not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS:
        raise AnnouncementError(f"an announced uuid must be a string of 1-{MAX_UUID_CHARS} characters")
    return uuid


def _announced(uuid: str, item: object, dtypes: Collection[str]) -> Announced:
    if not isinstance(item, Mapping):
        raise AnnouncementError(f"announced item {uuid} must be an object with rows, width and dtype")
    rows, width, dtype = _count(uuid, item, "rows"), _count(uuid, item, "width"), item.get("dtype")
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise AnnouncementError(f"announced item {uuid}: dtype {dtype!r} is not one of {sorted(dtypes)}")
    producer = item.get("producer")
    if producer is not None and (not isinstance(producer, str) or not 0 < len(producer) <= MAX_UUID_CHARS):
        raise AnnouncementError(f"announced item {uuid}: producer must be a ZMQ endpoint, not {producer!r}")
    return Announced(rows, width, dtype, producer)


def _count(uuid: str, item: Mapping[str, object], name: str) -> int:
    value = item.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AnnouncementError(f"announced item {uuid}: {name} must be a positive integer, not {value!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Tally:
    supply: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)


def admit(
    items: Iterable[Item],
    announced: Mapping[str, Announced],
    held: Callable[[str], HeldShape | None],
    model_width: int,
) -> Verdict:
    """What the connector does for a request's items (see the module docstring). `held(uuid)` is what the store
    holds now; `model_width` 0 leaves the width unchecked."""
    tally = _Tally()
    for item in items:
        if item.done:
            continue
        failure = _admit_item(item, announced.get(item.uuid), held, model_width, tally)
        if failure is not None:
            return Verdict(reason=failure[0], failure=failure[1])
    return Verdict(frozenset(tally.supply), tuple(tally.missing))


def _admit_item(
    item: Item,
    announcement: Announced | None,
    held: Callable[[str], HeldShape | None],
    model_width: int,
    tally: _Tally,
) -> tuple[str, str] | None:
    """None, or (the failure's kind, why) for a request with this item."""
    if announcement is None:
        if item.has_content:
            return None  # vLLM's own to encode
        return (
            "unannounced",
            f"item {item.uuid} carries no pixels and its request's ec_transfer_params does not announce it",
        )
    why = _disagrees(announcement, item.rows, model_width)
    if why is None:
        tensor = held(item.uuid)
        if tensor is None:
            if not item.has_content:
                tally.missing.append(item.uuid)
            return None
        why = _differs(tensor, announcement)
        if why is None:
            tally.supply.add(item.uuid)
            return None
    return None if item.has_content else ("mismatch", f"item {item.uuid}: {why}")


def _disagrees(announcement: Announced, rows: int, model_width: int) -> str | None:
    if announcement.rows != rows:
        return f"announced {announcement.rows} rows, the request's placeholder needs {rows}"
    if model_width and announcement.width != model_width:
        return f"announced width {announcement.width}, this model needs {model_width}"
    return None


def _differs(tensor: HeldShape, announcement: Announced) -> str | None:
    have = (tensor.rows, tensor.width, tensor.dtype)
    want = (announcement.rows, announcement.width, announcement.dtype)
    if have != want:
        return "holds {} x {} {}, announced {} x {} {}".format(*have, *want)
    return None


def keep_waiting(
    missing: Collection[str], waited_s: float, wait_s: float, receiver_failure: str | None
) -> str | None:
    """Why a request whose announced items are `missing` must fail now (None: defer it once more): its wait is
    over, or the receiver failed since it began (what it waits for may never be taken)."""
    first = next(iter(missing))
    if receiver_failure is not None:
        return f"item {first} is not here and the connector's receiver failed meanwhile: {receiver_failure}"
    if waited_s >= wait_s:
        return f"item {first} never arrived (waited {wait_s:g} s, the connector's wait_s)"
    return None
