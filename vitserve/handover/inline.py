"""--llm_transport inline (the default): each embedding travels in the chat request's body, as base64.

vLLM started with --enable-mm-embeds takes precomputed embeddings in place of an image (docs/vllm.md):
- Qwen2-VL / Qwen2.5-VL: `{"type": "image_embeds", "image_embeds": {"image_embeds": B64, "image_grid_thw":
  [t, h, w]}}`. The grid sets how many placeholder tokens the prompt gets (t*h*w / merge**2) and the M-RoPE
  positions, so it is the grid the processor made, flat.
- Qwen3-VL / Qwen3.5: the same, with the DeepStack features concatenated along the hidden dimension in
  `deepstack_visual_indexes` order: `[main, ds_0, ds_1, ...]`, shape (N, hidden * (1 + levels)).
- InternVL: a bare base64 tensor of shape (1, N, hidden).
- a video: `{"type": "video_embeds", "video_embeds": {"video_embeds": B64, "video_grid_thw": [T, h, w]}}`,
  and for Qwen3-VL / Qwen3.5 each group's `timestamps`.

B64 is base64 of `.npy` bytes (numpy's format: no pickle; vLLM recognises its magic and loads it with
np.load), or for bfloat16, which numpy lacks, of `torch.save` bytes (vLLM loads them with
torch.load(weights_only=True)): the tower's dtype on the wire, and vLLM casts to its own. The parts built here
hold the tensor (handover/inline_body.py InlineTensor); its base64 is spliced into the body when it is
serialized. Nothing is held between requests, nothing is checked after the parts are made, and the LLM
server's answer is relayed as it came.
"""

from __future__ import annotations

from typing import Any

from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.handover.base import Handover, Transport
from vitserve.handover.embeds import (
    EmbedsLayout,
    check_tensor,
    checked_video_tensor,
    llm_tensor,
    video_timestamps,
)
from vitserve.handover.inline_body import InlineTensor
from vitserve.transport_specs import InlineSpec


def embeds_part(layout: EmbedsLayout, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
    """The content part that replaces image `index`'s `image_url` part, checked."""
    tensor = llm_tensor(layout, result)
    check_tensor(layout, image, tensor, index)
    if layout.tiles:
        return {"type": "image_embeds", "image_embeds": InlineTensor(tensor.unsqueeze(0))}  # (1, N, hidden)
    return {
        "type": "image_embeds",
        "image_embeds": {"image_embeds": InlineTensor(tensor), "image_grid_thw": list(image.item.grid_thw)},
    }


def video_embeds_part(
    layout: EmbedsLayout, video: PreparedVideo, results: list[ItemResult], index: int
) -> dict[str, Any]:
    """The content part that replaces video `index`'s `video_url` part, checked: `video_grid_thw` [T, h, w],
    and for Qwen3-VL / Qwen3.5 each group's `timestamps` (the "<t seconds>" text vLLM puts before it).
    Qwen2.5-VL's second_per_grid_ts is not sent: vLLM takes none (EmbedsLayout.check_video_time)."""
    tensor, grid = checked_video_tensor(layout, video, results, index)
    embeds: dict[str, Any] = {"video_embeds": InlineTensor(tensor), "video_grid_thw": grid}
    if layout.video_time == "timestamps":
        embeds["timestamps"] = video_timestamps(video)
    return {"type": "video_embeds", "video_embeds": embeds}


class InlineHandover(Handover):
    """One request: its parts hold their tensors, and the body carries them."""

    def __init__(self, transport: InlineTransport):
        self.transport = transport

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        return embeds_part(self.transport.layout, image, result, index)

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        return video_embeds_part(self.transport.layout, video, results, index)

    async def ready(self, payload: dict[str, Any]) -> bytes:
        return await self.transport.body(payload)


class InlineTransport(InlineSpec, Transport):
    def begin(self) -> InlineHandover:
        return InlineHandover(self)
