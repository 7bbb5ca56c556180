"""Fakes that are real implementations of vitserve's interfaces, for tests where a real part cannot run."""


# --- tp helper: an Encoder over a real HF tower (until vitserve.model.load_encoder is on main) ---------------

import torch as _torch  # noqa: E402

from vitserve.types import EncodedImage as _EncodedImage  # noqa: E402


class TowerEncoder:
    """A real Encoder (vitserve/model/base.py) over an HF vision tower built in-process (tests/tp_towers.py).

    One packed forward per encode() call, like production: Qwen rows are concatenated with their grid_thw;
    InternVL tiles are stacked along the batch axis.
    """

    def __init__(self, family: str, visual, *, model_name: str = "tiny", device: str = "cpu"):
        self.family = family
        self.model_name = model_name
        self.visual = visual.to(device)
        self.device = _torch.device(device)
        self.dtype = next(visual.parameters()).dtype
        self.num_deepstack = len(getattr(getattr(visual, "config", None), "deepstack_visual_indexes", None) or [])
        self.embed_dim = self._out_dim()

    def _out_dim(self) -> int:
        if self.family == "internvl":
            return self.visual.multi_modal_projector.linear_2.out_features
        cfg = self.visual.config
        return getattr(cfg, "out_hidden_size", None) or cfg.hidden_size

    def encode(self, items):
        if not items:
            return []
        pixels = _torch.cat([i.pixel_values for i in items]).to(self.device, self.dtype)
        with _torch.inference_mode():
            if self.family == "internvl":
                feats = self.visual(pixels)  # (tiles, tokens_per_tile, dim)
                tiles = [i.pixel_values.shape[0] for i in items]
                return [_EncodedImage(f.reshape(-1, f.shape[-1])) for f in feats.split(tiles)]
            grid = _torch.tensor([i.grid_thw for i in items], device=self.device)
            out = self.visual(pixels, grid_thw=grid)
        sizes = [i.num_tokens for i in items]
        embeds = out.pooler_output.split(sizes)  # each (num_tokens, dim)
        deep = [d.split(sizes) for d in (getattr(out, "deepstack_features", None) or [])]
        return [_EncodedImage(e, [d[k] for d in deep]) for k, e in enumerate(embeds)]
