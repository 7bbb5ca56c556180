"""Every message between the engine (API process) and the encoder workers, in one place.

On ZMQ a message is a multipart message: frame 0 is a msgpack map (the header), frames 1.. are raw
tensor bytes described by the header's "tensors" list (vitserve/rpc/tensors.py). No pickle: a frame that
is not a valid header of a known kind and version raises MessageError and is dropped by the reader.

Inside a TP group, rank 0 forwards what it received to its peers over torch.distributed (see
broadcast.py); that path carries only int64 metadata and the pixel tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import msgpack
import torch

from vitserve.contract import EncodedImage, ProcessedImage
from vitserve.rpc.tensors import dtype_name, tensor_from_buffer, tensor_to_buffer

VERSION = 1


class MessageError(ValueError):
    """A frame that is not a well-formed vitserve internal message (garbage, pickle, wrong version)."""


class SlotError(MessageError):
    """A well-formed RESULT whose result slot cannot be read: the engine fails that batch's jobs."""

    def __init__(self, message: str, group: int, batch_id: int):
        super().__init__(message)
        self.group, self.batch_id = group, batch_id


class Kind(str, Enum):  # noqa: UP042 (str(Kind.X) stays "Kind.X" in logs; the wire uses .value)
    # engine -> rank 0
    BATCH = "batch"  # encode these images
    STOP = "stop"  # finish the loop and exit cleanly
    # rank 0 -> its TP peers only (torch.distributed); never on ZMQ
    HEARTBEAT = "heartbeat"  # an empty batch that keeps peers' collectives from timing out
    # any rank -> engine (status socket)
    READY = "ready"  # start-up (incl. reservation) done
    ALIVE = "alive"  # periodic liveness report
    RESULT = "result"  # rank 0: embeddings of one batch
    ERROR = "error"  # this rank failed (start-up or forward) and is exiting


@dataclass
class BatchMsg:
    batch_id: int  # engine-assigned, unique per engine
    items: list[ProcessedImage]  # in queue order; outputs come back in the same order
    slot: str = ""  # a result slot the engine lent for the outputs (worker/slots.py); "" for none
    kind: Kind = Kind.BATCH


@dataclass
class StopMsg:
    kind: Kind = Kind.STOP


@dataclass
class ReadyMsg:
    group: int  # DP group index
    rank: int  # rank inside the group (0..tp-1)
    pid: int
    model_name: str
    family: str
    embed_dim: int
    num_deepstack: int
    dtype: str  # wire name, e.g. "float32"
    device: str  # e.g. "cpu", "cuda:1"
    reserved_bytes: int  # activation memory reserved by the start-up stress (or the override)
    reserved_source: Literal["stress", "override"]  # worker/reservation Reservation.source
    weights_digest: str  # the content digest of the weights it loaded (checkpoint.WeightsDigest)
    budget_tokens: int = (
        0  # the budget it reserved for: --visual_batch_max_tokens, or chosen for --visual_mem_gb
    )
    sizing: dict[str, Any] | None = None  # --visual_mem_gb alone: why that budget (Reservation.sizing)
    kind: Kind = Kind.READY

    def __post_init__(self) -> None:
        if self.reserved_source not in ("stress", "override"):  # decode: a MessageError, not a bad EngineInfo
            raise ValueError(f"reserved_source {self.reserved_source!r} is not stress or override")


@dataclass
class AliveMsg:
    group: int
    rank: int
    heartbeats: int  # heartbeats this rank has broadcast (rank 0) or received (peers) so far
    batches: int  # batches this rank has executed so far
    kind: Kind = Kind.ALIVE


@dataclass
class ResultMsg:
    group: int
    batch_id: int
    outputs: list[EncodedImage] = field(default_factory=list)  # one per item of the batch, same order
    forward_s: float = 0.0  # rank 0's wall time in the forward (vitserve_stage_seconds{stage="forward"})
    kind: Kind = Kind.RESULT


@dataclass
class ErrorMsg:
    group: int
    rank: int
    stage: str  # "startup" | "forward"
    message: str  # the exception, as text (never a pickled exception)
    batch_id: int = -1  # the batch that failed, -1 outside a forward
    setting: bool = False  # a setting that can never work (errors.MemoryTargetError): the CLI exits 2
    kind: Kind = Kind.ERROR


Message = BatchMsg | StopMsg | ReadyMsg | AliveMsg | ResultMsg | ErrorMsg
_PLAIN: dict[Kind, type[StopMsg | ReadyMsg | AliveMsg | ErrorMsg]] = {
    Kind.STOP: StopMsg,
    Kind.READY: ReadyMsg,
    Kind.ALIVE: AliveMsg,
    Kind.ERROR: ErrorMsg,
}


# ---------------------------------------------------------------------------------------------- encode


def _pack(header: dict[str, Any], tensors: list[torch.Tensor]) -> list[bytes | memoryview]:
    header = {"v": VERSION, **header, "tensors": [[dtype_name(t.dtype), list(t.shape)] for t in tensors]}
    return [msgpack.packb(header), *(tensor_to_buffer(t) for t in tensors)]


def encode(msg: Message) -> list[bytes | memoryview]:
    """The ZMQ frames of one message."""
    if isinstance(msg, BatchMsg):
        items = [
            {
                "grid_thw": list(it.grid_thw),
                "num_tokens": it.num_tokens,
                "resized_size": list(it.resized_size),
                "clamped": it.clamped,
            }
            for it in msg.items
        ]
        return _pack(
            {"kind": msg.kind.value, "batch_id": msg.batch_id, "items": items, "slot": msg.slot},
            [it.pixel_values for it in msg.items],
        )
    if isinstance(msg, ResultMsg):
        tensors = [t for out in msg.outputs for t in (out.embedding, *out.deepstack)]
        counts = [len(out.deepstack) for out in msg.outputs]
        return _pack(
            {
                "kind": msg.kind.value,
                "group": msg.group,
                "batch_id": msg.batch_id,
                "deepstack_counts": counts,
                "forward_s": msg.forward_s,
            },
            tensors,
        )
    fields = {k: (v.value if isinstance(v, Kind) else v) for k, v in vars(msg).items()}
    return _pack(fields, [])


def in_slot(
    frames: Sequence[bytes | memoryview], slot: str, spans: list[tuple[int, int]]
) -> list[bytes | memoryview]:
    """A message whose tensor frames were written into the result slot `slot` at `spans`
    (worker/slots.py write_slot): its header alone, naming them."""
    header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    return [msgpack.packb({**header, "slot": slot, "spans": [list(s) for s in spans]})]


# ---------------------------------------------------------------------------------------------- decode

# The engine's reading of a result slot: (slot, spans) -> one buffer per span (worker/slots.py ResultSlots.buffers)
SlotReader = Callable[[str, list[list[int]]], list[memoryview]]


def _unpack(
    frames: Sequence[bytes | memoryview], slots: SlotReader | None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    if not frames:
        raise MessageError("empty message")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise MessageError(f"frame 0 is not a msgpack header: {exc}") from exc
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise MessageError(f"not a version-{VERSION} vitserve message")
    specs = header.pop("tensors", [])
    in_a_slot = "spans" in header  # _slot_buffers takes the spans out of the header
    buffers = _slot_buffers(header, frames, slots) if in_a_slot else list(frames[1:])
    if not isinstance(specs, list) or len(specs) != len(buffers):
        raise MessageError(
            f"header describes {len(specs) if isinstance(specs, list) else '?'} tensors "
            f"but {len(buffers)} {'spans' if in_a_slot else 'frames'} follow"
        )
    try:
        tensors = [
            tensor_from_buffer(buf, dt, shape) for buf, (dt, shape) in zip(buffers, specs, strict=False)
        ]
    except (ValueError, TypeError) as exc:
        raise MessageError(f"bad tensor frame: {exc}") from exc
    return header, tensors


def _slot_buffers(
    header: dict[str, Any], frames: Sequence[bytes | memoryview], slots: SlotReader | None
) -> list[memoryview]:
    slot, spans = header.pop("slot", None), header.pop("spans")
    if slots is None or header.get("kind") != Kind.RESULT.value:
        raise MessageError("a message in a result slot where none was lent")
    if len(frames) != 1 or not isinstance(slot, str) or not isinstance(spans, list):
        raise MessageError("a result slot's message is its header alone, naming the slot and spans")
    if not all(isinstance(s, list) and len(s) == 2 and all(type(v) is int for v in s) for s in spans):
        raise MessageError(f"bad result slot spans {spans!r}")
    try:
        return slots(slot, spans)
    except (ValueError, OSError) as exc:  # not lent, spans past what was written, no memory to map it
        group, batch_id = header.get("group"), header.get("batch_id")
        if type(group) is not int or type(batch_id) is not int:
            raise MessageError(f"a result slot's header without its group and batch: {exc}") from exc
        raise SlotError(
            f"result slot {slot!r} of batch {batch_id} cannot be read: {exc}", group, batch_id
        ) from exc


def decode(frames: Sequence[bytes | memoryview], slots: SlotReader | None = None) -> Message:
    """One message from its ZMQ frames; raises MessageError on anything malformed. `slots`: the engine's
    result slots, where a RESULT's tensors may be (in_slot)."""
    header, tensors = _unpack(frames, slots)
    header.pop("v")
    try:
        kind = Kind(header.pop("kind", None))
        if kind is Kind.BATCH:
            return _decode_batch(header, tensors)
        if kind is Kind.RESULT:
            return _decode_result(header, tensors)
        if kind not in _PLAIN or tensors:
            raise MessageError(f"unexpected message kind {kind.value!r} on a ZMQ socket")
        return _PLAIN[kind](**header)
    except (ValueError, TypeError, KeyError) as exc:
        raise MessageError(f"malformed message: {exc}") from exc


def _decode_batch(header: dict[str, Any], tensors: list[torch.Tensor]) -> BatchMsg:
    metas = header["items"]
    if len(metas) != len(tensors):
        raise MessageError(f"batch lists {len(metas)} items but carries {len(tensors)} tensors")
    items = [
        ProcessedImage(
            pixel_values=pv,
            grid_thw=tuple(m["grid_thw"]),
            num_tokens=int(m["num_tokens"]),
            resized_size=tuple(m["resized_size"]),
            clamped=bool(m["clamped"]),
        )
        for m, pv in zip(metas, tensors, strict=False)
    ]
    slot = header.get("slot", "")
    if not isinstance(slot, str):
        raise MessageError(f"bad result slot {slot!r}")
    return BatchMsg(batch_id=int(header["batch_id"]), items=items, slot=slot)


def _decode_result(header: dict[str, Any], tensors: list[torch.Tensor]) -> ResultMsg:
    counts = header["deepstack_counts"]
    if sum(1 + c for c in counts) != len(tensors):
        raise MessageError("result frame count does not match its deepstack counts")
    outputs, pos = [], 0
    for c in counts:
        outputs.append(EncodedImage(embedding=tensors[pos], deepstack=tensors[pos + 1 : pos + 1 + c]))
        pos += 1 + c
    return ResultMsg(
        group=int(header["group"]),
        batch_id=int(header["batch_id"]),
        outputs=outputs,
        forward_s=float(header.get("forward_s", 0.0)),
    )
