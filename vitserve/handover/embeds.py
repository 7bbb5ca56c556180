"""What the LLM server assumes of an embedding, and the check every transport's tensor passes before it leaves.

vLLM does not check every field of an embedding part (docs/vllm.md): fewer rows than the grid implies, a 3-D
tensor for a Qwen model or the wrong width kill its engine process (EngineDeadError), and the dict form has
no width check at all; its encoder-cache connectors take a file's rows on trust. So every tensor is checked
here against what the LLM will assume (`EmbedsLayout`: rows from the grid, the width with Qwen3-VL's
DeepStack levels concatenated after the main rows), and a mismatch is vitserve's own 500 that never reaches
the LLM server. The parts themselves are each transport's (handover/inline.py, handover/ec_storage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.errors import InvalidRequest, InvalidVideoSampling, VitserveError
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
    # the vision config's tokens_per_second (Qwen2.5-VL's M-RoPE time scale); None: the checkpoint names none
    tokens_per_second: float | None = None

    @property
    def tiles(self) -> bool:
        return FAMILIES[self.family].layout == "tiles"

    @property
    def video_time(self) -> str:
        """What the LLM is told of a video's time: "none", "second_per_grid" or "timestamps"."""
        return FAMILIES[self.family].video_time

    def check_split(self, what: str, main: torch.Tensor, deep: list[torch.Tensor], grid: list[int]) -> None:
        """Refuse (500) an item's main rows and DeepStack levels whose rows or summed width are not what the LLM
        will assume for `grid`, before anything is sent (the uuid transports send them unjoined)."""
        rows = self.grid_rows(grid)
        shapes = [tuple(t.shape) for t in (main, *deep)]
        width = sum(s[1] for s in shapes if len(s) == 2)
        if any(len(s) != 2 or s[0] != rows for s in shapes) or width != self.width:
            raise EmbeddingMismatch(
                f"{what}: embedding of shapes {shapes}, but the LLM server expects ({rows}, {self.width}) "
                f"for grid {grid} ({self.family}); nothing was sent to it"
            )

    def check_video_served(self) -> None:
        """400 before any decoding for a family whose video embeddings vLLM takes in another form."""
        if self.tiles:
            raise InvalidRequest(
                f"video_url parts are not served for {self.family} through /v1/chat/completions: vLLM takes "
                "this family's video embeddings per frame with its own prompt layout, which vitserve does not "
                "build (docs/vllm.md); send the video to /encode"
            )

    def check_video_time(self, video: PreparedVideo) -> None:
        """400 for a Qwen2.5-VL video whose time positions vLLM would get wrong.

        vLLM (0.32) takes no `second_per_grid_ts` with `video_embeds` (a number fails the request, a tensor is
        dropped) and places group t at M-RoPE time int(t * 1.0 * tokens_per_second), as for one second per
        group. The video's own positions are int(t * second_per_grid_t * tokens_per_second) (transformers'
        and vLLM's raw-video rule); where the two differ for any group, the answer would not be the model's,
        so the video is refused, naming its second_per_grid_t."""
        if self.video_time != "second_per_grid":
            return
        spg = video.metadata.second_per_grid_t
        if spg is None:
            raise ValueError(
                f"a {self.family} video without second_per_grid_t"
            )  # the family's processor sets it
        groups = np.arange(video.metadata.grid_thw[0])
        tps = self.tokens_per_second
        if tps is None:  # the checkpoint names no time scale: only exactly one second per group is safe
            same = spg == 1.0
        else:
            same = bool(
                np.array_equal((groups * (spg * tps)).astype(np.int64), (groups * tps).astype(np.int64))
            )
        if not same:
            raise InvalidVideoSampling(
                f"the video's temporal groups are {spg:.4g} s apart (second_per_grid_ts = temporal_patch_size / "
                "sampled fps), but vLLM's video_embeds input takes no second_per_grid_ts and assumes 1 s per "
                "group, which would give the LLM wrong time positions; sample the video so that its groups are "
                "1 s apart (mm_processor_kwargs.fps = 2 for 2-frame groups, or a num_frames of 2 per second), "
                "or send it to a server that decodes it itself (docs/vllm.md, 'Video')"
            )

    def grid_rows(self, grid: Sequence[int]) -> int:
        """Rows the LLM assumes for a patch grid [t, h, w]: t*h*w / merge_size**2 (patch layouts)."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def expected_rows(self, image: PreparedImage) -> int:
        if self.tiles:  # tiles x tokens per tile: the count the processor planned
            return image.item.num_tokens
        return self.grid_rows(image.item.grid_thw)


def llm_tensor(layout: EmbedsLayout, result: ItemResult) -> torch.Tensor:
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


def video_tensor(layout: EmbedsLayout, video: PreparedVideo, results: list[ItemResult]) -> torch.Tensor:
    """The video's rows in time order, its groups joined (each DeepStack level joined the same way, then
    concatenated after the main rows as for an image)."""
    if any(r.embedding is None for r in results):
        raise EmbeddingMismatch("the engine returned no embedding for a video group of a chat request")
    main = torch.cat([r.embedding for r in results if r.embedding is not None])
    levels = len(results[0].deepstack) if results else 0
    deep = [torch.cat([r.deepstack[k] for r in results]) for k in range(levels)]
    return torch.cat([main, *deep], dim=1) if deep else main


def video_timestamps(video: PreparedVideo) -> list[float]:
    """A Qwen3-VL / Qwen3.5 video's `timestamps`, each group's time in seconds (the part's field)."""
    if video.metadata.timestamps_s is None:
        raise ValueError("a video without timestamps_s")  # the family's processor sets them
    return list(video.metadata.timestamps_s)


def checked_video_tensor(
    layout: EmbedsLayout, video: PreparedVideo, results: list[ItemResult], index: int
) -> tuple[torch.Tensor, list[int]]:
    """The video's tensor and its flat grid [T, h, w], refused (500) when its shape is not the LLM's."""
    tensor = video_tensor(layout, video, results)
    grid = list(video.metadata.grid_thw)
    rows = layout.grid_rows(grid)
    if tensor.dim() != 2 or tuple(tensor.shape) != (rows, layout.width):
        raise EmbeddingMismatch(
            f"video {index}: embedding of shape {tuple(tensor.shape)}, but the LLM server expects "
            f"({rows}, {layout.width}) for grid {grid} ({layout.family}); nothing was sent to it"
        )
    return tensor, grid


def video_rows(results: Sequence[ItemResult]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A video's groups joined in time order: its main rows (T*h*w/m^2, hidden) and each DeepStack level's."""
    if any(r.embedding is None for r in results):
        raise EmbeddingMismatch("the engine returned no embedding for a video group of a chat request")
    main = torch.cat([r.embedding for r in results if r.embedding is not None])
    levels = len(results[0].deepstack) if results else 0
    return main, [torch.cat([r.deepstack[k] for r in results]) for k in range(levels)]
