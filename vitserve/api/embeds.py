"""The LLM server's embedding part for one encoded image, and the check it passes before it leaves.

vLLM started with --enable-mm-embeds takes precomputed embeddings in place of an image (docs/vllm.md):
- Qwen2-VL / Qwen2.5-VL: `{"type": "image_embeds", "image_embeds": {"image_embeds": B64, "image_grid_thw":
  [t, h, w]}}`. The grid sets how many placeholder tokens the prompt gets (t*h*w / merge**2) and the M-RoPE
  positions, so it is the grid the processor made, flat.
- Qwen3-VL / Qwen3.5: the same, with the DeepStack features concatenated along the hidden dimension in
  `deepstack_visual_indexes` order: `[main, ds_0, ds_1, ...]`, shape (N, hidden * (1 + levels)).
- InternVL: a bare base64 tensor of shape (1, N, hidden).

B64 is base64 of `.npy` bytes (numpy's format: no pickle; vLLM recognises its magic and loads it with
np.load). bfloat16 has no numpy dtype: it is widened to float32, exactly, and vLLM casts to its own dtype.

vLLM does not check every field of these payloads: fewer rows than the grid implies, a 3-D tensor for a
Qwen model or the wrong width kill its engine process (EngineDeadError), and the dict form has no width
check at all. So every tensor is checked here against what the LLM will assume, and a mismatch is
vitserve's own 500 that never reaches the LLM server.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitserve.contract import ImageResult, PreparedImage
from vitserve.errors import VitserveError
from vitserve.families import FAMILIES


class EmbeddingMismatch(VitserveError):
    """An embedding that does not have the shape the LLM server will assume: a vitserve bug or a checkpoint
    whose tower and language model disagree; never sent upstream."""

    status, code = 500, "embedding_mismatch"


@dataclass(frozen=True)
class EmbedsLayout:
    """What the LLM server assumes of one image's embedding, for one checkpoint."""

    family: str
    merge_size: int  # patch layouts: rows = t*h*w / merge_size**2; tiles: unused
    width: int  # the row width the LLM expects: its hidden size times (1 + DeepStack levels)

    @property
    def tiles(self) -> bool:
        return FAMILIES[self.family].layout == "tiles"

    def expected_rows(self, image: PreparedImage) -> int:
        if self.tiles:  # tiles x tokens per tile: the count the processor planned
            return image.item.num_tokens
        t, h, w = image.item.grid_thw
        return t * h * w // (self.merge_size * self.merge_size)


def npy_b64(t: torch.Tensor) -> str:
    """base64 of the tensor as `.npy` bytes (little-endian, C order)."""
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16; widening is exact
    buf = io.BytesIO()
    np.lib.format.write_array(buf, t.detach().cpu().contiguous().numpy(), allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def llm_tensor(layout: EmbedsLayout, result: ImageResult) -> torch.Tensor:
    """The image's rows as the LLM takes them: (N, width); DeepStack levels concatenated after the main."""
    if result.embedding is None:
        raise EmbeddingMismatch("the engine returned no embedding for an image of a chat request")
    if result.deepstack:
        return torch.cat([result.embedding, *result.deepstack], dim=1)  # (N, hidden * (1 + levels))
    return result.embedding


def check_tensor(layout: EmbedsLayout, image: PreparedImage, tensor: torch.Tensor, index: int) -> None:
    """Refuse (500) a tensor whose rows or width differ from what the LLM server will assume."""
    rows = layout.expected_rows(image)
    if tensor.dim() != 2 or tuple(tensor.shape) != (rows, layout.width):
        raise EmbeddingMismatch(
            f"image {index}: embedding of shape {tuple(tensor.shape)}, but the LLM server expects "
            f"({rows}, {layout.width}) for grid {list(image.item.grid_thw)} ({layout.family}); "
            "nothing was sent to it"
        )


def embeds_part(
    layout: EmbedsLayout, image: PreparedImage, result: ImageResult, index: int
) -> dict[str, Any]:
    """The content part that replaces image `index`'s `image_url` part, checked."""
    tensor = llm_tensor(layout, result)
    check_tensor(layout, image, tensor, index)
    if layout.tiles:
        return {"type": "image_embeds", "image_embeds": npy_b64(tensor.unsqueeze(0))}  # (1, N, hidden)
    return {
        "type": "image_embeds",
        "image_embeds": {"image_embeds": npy_b64(tensor), "image_grid_thw": list(image.item.grid_thw)},
    }
