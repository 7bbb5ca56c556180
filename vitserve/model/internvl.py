"""InternVL's vision path as one module: vision tower -> drop CLS -> pixel shuffle -> projector.

transformers keeps these steps inside InternVLModel.get_image_features (next to the language model); this
module holds only the two vision submodules under HF's names, so checkpoint keys map by prefix and the TP
pass finds the usual layer names, and runs exactly the same operations.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, InternVLConfig
from transformers.models.internvl.modeling_internvl import InternVLModel, InternVLMultiModalProjector


class InternVLVisual(nn.Module):
    def __init__(self, config: InternVLConfig) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self.downsample_ratio = config.downsample_ratio
        self.vision_feature_layer = config.vision_feature_layer
        self.vision_feature_select_strategy = config.vision_feature_select_strategy
        if not isinstance(self.vision_feature_layer, int):
            raise ValueError(
                f"vision_feature_layer must be one layer index, got {self.vision_feature_layer!r}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values (tiles, C, H, W) -> (tiles, tokens_per_tile, dim), as InternVLModel.get_image_features."""
        if self.vision_feature_layer == -1:
            features = self.vision_tower(pixel_values=pixel_values).last_hidden_state  # (tiles, 1+HW, C)
        else:
            out = self.vision_tower(pixel_values=pixel_values, output_hidden_states=True)
            features = out.hidden_states[self.vision_feature_layer]
        if self.vision_feature_select_strategy == "default":
            features = features[:, 1:, :]  # drop CLS -> (tiles, HW, C)
        tiles, positions, _ = features.shape
        side = int(positions**0.5)
        features = features.reshape(tiles, side, side, -1)  # (tiles, H, W, C)
        # pixel_shuffle does not use the model; call HF's own implementation so the ordering is identical.
        features = InternVLModel.pixel_shuffle(None, features, scale_factor=self.downsample_ratio)  # type: ignore[arg-type]
        features = features.reshape(tiles, -1, features.shape[-1])  # (tiles, HW*r^2, C/r^2)
        projected: torch.Tensor = self.multi_modal_projector(features)  # (tiles, tokens_per_tile, dim)
        return projected
