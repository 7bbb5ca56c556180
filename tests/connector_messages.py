"""A small DeepStack embedding message as vitserve pushes or a producer serves it to the connector: main rows and
two DeepStack levels of 8 columns each (width 24), merge 2 over a (1, 6, 8) grid, for the connector's unit tests."""

from __future__ import annotations

import time

import torch

from vitserve.rpc.wire import ImageEmbedding

WIDTH = 24  # 8 main columns and 2 DeepStack levels of 8


def message(uuid: str, rows: int = 12, dtype: torch.dtype = torch.float32) -> ImageEmbedding:
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(rows, 8, generator=g).to(dtype) for _ in range(3)]
    return ImageEmbedding(
        request_id="r",
        image_index=0,
        num_images=1,
        image_id="0" * 64,
        grid_thw=(1, 6, 8),
        embedding=parts[0],
        deepstack=parts[1:],
        expires_at=time.time() + 60,
        uuid=uuid,
    )
