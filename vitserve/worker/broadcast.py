"""Rank 0 -> TP peers: what to do next, over torch.distributed (gloo on CPU, NCCL on CUDA).

Only rank 0 decides; peers execute exactly what it broadcast (docs/design.md invariant 4). One step is:
  1. a fixed-size int64 meta tensor [kind, batch_id, n_items, pv_ndim, dtype_code, total_numel]
  2. (BATCH only) an int64 table, one row per item: t, h, w, num_tokens, width, height, clamped, *pv_shape
  3. (BATCH only) every item's pixel_values flattened and concatenated, in one collective
HEARTBEAT and STOP are just step 1 with n_items = 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vitserve.contract import ProcessedImage
from vitserve.worker.messages import BatchMsg, Kind

_KIND_CODES = {Kind.HEARTBEAT: 0, Kind.BATCH: 1, Kind.STOP: 2}
_KINDS = {v: k for k, v in _KIND_CODES.items()}
_PIXEL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
]  # index = the dtype code broadcast to the peers
_META_LEN = 6
_FIXED_COLS = 7  # t, h, w, num_tokens, width, height, clamped


def send_step(kind: Kind, batch: BatchMsg | None, device: torch.device) -> None:
    """Rank 0: broadcast the next step to every peer of the group."""
    items = batch.items if batch is not None else []
    pv = [it.pixel_values for it in items]
    ndim = pv[0].dim() if pv else 0
    dtype_code = _PIXEL_DTYPES.index(pv[0].dtype) if pv else 0
    total = sum(t.numel() for t in pv)
    batch_id = batch.batch_id if batch is not None else -1
    meta = torch.tensor([_KIND_CODES[kind], batch_id, len(items), ndim, dtype_code, total], dtype=torch.int64)
    dist.broadcast(meta.to(device), src=0)
    if kind is not Kind.BATCH:
        return
    rows = [
        [*it.grid_thw, it.num_tokens, *it.resized_size, int(it.clamped), *it.pixel_values.shape]
        for it in items
    ]
    dist.broadcast(torch.tensor(rows, dtype=torch.int64).to(device), src=0)  # (n_items, 7 + ndim)
    flat = torch.cat([t.reshape(-1) for t in pv]).to(device)  # (total_numel,)
    dist.broadcast(flat, src=0)


def recv_step(device: torch.device) -> tuple[Kind, BatchMsg | None]:
    """Peers: block until rank 0 broadcasts the next step; returns the same batch rank 0 will run."""
    meta = torch.empty(_META_LEN, dtype=torch.int64, device=device)
    dist.broadcast(meta, src=0)
    code, batch_id, n_items, ndim, dtype_code, total = (int(v) for v in meta.cpu())
    kind = _KINDS[code]
    if kind is not Kind.BATCH:
        return kind, None
    table = torch.empty((n_items, _FIXED_COLS + ndim), dtype=torch.int64, device=device)
    dist.broadcast(table, src=0)
    flat = torch.empty(total, dtype=_PIXEL_DTYPES[dtype_code], device=device)
    dist.broadcast(flat, src=0)
    return kind, BatchMsg(
        batch_id=batch_id, items=_rebuild(table.cpu().tolist(), flat)
    )  # pixels stay on device


def _rebuild(rows: list[list[int]], flat: torch.Tensor) -> list[ProcessedImage]:
    items, pos = [], 0
    for t, h, w, num_tokens, width, height, clamped, *shape in rows:
        n = 1
        for d in shape:
            n *= d
        items.append(
            ProcessedImage(
                pixel_values=flat[pos : pos + n].reshape(shape),
                grid_thw=(t, h, w),
                num_tokens=num_tokens,
                resized_size=(width, height),
                clamped=bool(clamped),
            )
        )
        pos += n
    return items
