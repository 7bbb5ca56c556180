"""--image_resize torch (the default) against transformers' torchvision ("fast") image processors, bit for bit.

The oracle is transformers' own torchvision processor (Qwen2VLImageProcessor, GotOcr2ImageProcessor) built
from the same checkpoint, called on the image where its own resize gives vitserve's planned size, and, where
vitserve caps what HF would overshoot, on the image resized to the planned size by torchvision itself
(do_resize=False). vitserve reproduces it with torch alone (vitserve/processors/pixels.py); equality is exact
(torch.equal) because every step is the same correctly rounded operation (the uint8 resize is one and the
same kernel; the value table holds the backend's own float32 results).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF
from transformers import AutoImageProcessor

from bench.workloads import photo_like
from tests.checkpoints import make_checkpoint
from tests.imagegen import noise
from tests.unit.test_pixels import CHECKPOINT_CASES, QWEN, hf_oracle
from vitserve.processors import load_image_processor
from vitserve.processors.pixels import resize_uint8


def _torchvision_resize(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    width, height = size
    return tvF.resize(
        tvF.pil_to_tensor(image), [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True
    )


def torch_oracle(ref, proc, image: Image.Image) -> torch.Tensor:
    """The torchvision processor's pixels under vitserve's plan."""
    return hf_oracle(ref, proc, image, resize=_torchvision_resize)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixels-torch")
    return {family: make_checkpoint(family, root / family) for family in (*QWEN, "internvl")}


def _assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape
    assert torch.equal(got, want), f"max difference {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize(("budget", "size"), CHECKPOINT_CASES)
def test_torch_backend_equals_the_torchvision_processor(checkpoints, family, budget, size):
    ckpt = checkpoints[family]
    proc = load_image_processor(str(ckpt), budget, resize="torch")
    ref = AutoImageProcessor.from_pretrained(str(ckpt), backend="torchvision", local_files_only=True)
    image = photo_like(*size, seed=budget + size[0])
    _assert_equal(proc.preprocess(image).pixel_values, torch_oracle(ref, proc, image))


@pytest.mark.parametrize("family", QWEN)
def test_torch_backend_on_the_published_defaults_every_value_and_a_large_photo(family):
    proc = load_image_processor(family, 1024, resize="torch")
    assert proc.clamp_info()["image_resize"] == "torch"
    ref = _fast_twin(proc)
    values = np.arange(256, dtype=np.uint8).reshape(16, 16)
    every_value = np.stack([values, values.T, 255 - values], axis=-1).repeat(14, 0).repeat(14, 1)  # 224x224
    for image in (Image.fromarray(every_value), photo_like(1280, 960, seed=1), noise(333, 517, seed=2)):
        _assert_equal(proc.preprocess(image).pixel_values, torch_oracle(ref, proc, image))


def _fast_twin(proc):
    """transformers' torchvision Qwen2VLImageProcessor with the settings of vitserve's (clamped) one."""
    from transformers import Qwen2VLImageProcessor

    hf = proc.hf
    return Qwen2VLImageProcessor(
        size={"shortest_edge": proc.geometry.min_pixels, "longest_edge": proc.geometry.max_pixels},
        patch_size=hf.patch_size,
        temporal_patch_size=hf.temporal_patch_size,
        merge_size=hf.merge_size,
        image_mean=hf.image_mean,
        image_std=hf.image_std,
        rescale_factor=hf.rescale_factor,
    )


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16"])
def test_torch_backend_converts_every_mode_like_the_pil_path_then_resizes_like_torchvision(checkpoints, mode):
    ckpt = checkpoints["qwen2_5_vl"]
    proc = load_image_processor(str(ckpt), 16, resize="torch")
    ref = AutoImageProcessor.from_pretrained(str(ckpt), backend="torchvision", local_files_only=True)
    image = photo_like(300, 200, seed=4).convert(mode)
    rgb = load_image_processor(str(ckpt), 16, resize="pil")  # the documented RGB conversion is the same
    from vitserve.processors.base import as_rgb

    assert rgb.preprocess(image).grid_thw == proc.preprocess(image).grid_thw
    _assert_equal(proc.preprocess(image).pixel_values, torch_oracle(ref, proc, as_rgb(image)))


@pytest.mark.parametrize(
    ("budget", "size"), [(0, (300, 200)), (0, (50, 400)), (8, (500, 333)), (4, (40, 40))]
)
def test_internvl_torch_tiles_equal_the_torchvision_processor(checkpoints, budget, size):
    ckpt = checkpoints["internvl"]
    proc = load_image_processor(str(ckpt), budget, resize="torch")
    ref = AutoImageProcessor.from_pretrained(str(ckpt), backend="torchvision", local_files_only=True)
    image = photo_like(*size, seed=budget)
    out = ref(
        image,
        crop_to_patches=True,
        max_patches=proc.hf.max_patches,
        min_patches=proc.hf.min_patches,
        return_tensors="pt",
    )
    got = proc.preprocess(image)
    _assert_equal(got.pixel_values, out["pixel_values"])
    assert got.grid_thw[0] == out["pixel_values"].shape[0]


@pytest.mark.parametrize(
    ("src", "dst"), [((97, 61), (28, 56)), ((61, 97), (280, 140)), ((512, 384), (512, 384))]
)
def test_resize_uint8_is_torchvisions_uint8_bicubic_antialias(src, dst):
    pixels = np.random.default_rng(0).integers(0, 256, (*src[::-1], 3), dtype=np.uint8)
    want = tvF.resize(
        torch.from_numpy(pixels).permute(2, 0, 1),
        [dst[1], dst[0]],
        interpolation=InterpolationMode.BICUBIC,
        antialias=True,
    )
    assert np.array_equal(resize_uint8(pixels, dst), want.permute(1, 2, 0).numpy())


def test_the_backends_differ_so_the_choice_matters(checkpoints):
    ckpt = str(checkpoints["qwen2_5_vl"])
    image = photo_like(333, 217, seed=9)
    torch_px = load_image_processor(ckpt, 0, resize="torch").preprocess(image).pixel_values
    pil_px = load_image_processor(ckpt, 0, resize="pil").preprocess(image).pixel_values
    assert torch_px.shape == pil_px.shape
    assert (torch_px - pil_px).abs().max() > 0.01
    assert load_image_processor(ckpt, 0).clamp_info()["image_resize"] == "torch"  # auto is torch
