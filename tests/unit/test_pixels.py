"""The fast Qwen pixel path (vitserve/processors/pixels.py) with --image_resize pil against the real HF PIL image
processor, bit for bit (the torch backend: tests/unit/test_pixels_torch.py).

The oracle is a separate HF Qwen2VLImageProcessorPil built from the same config: called directly on the
image (with the budget's max_pixels) where HF's own resize gives the planned size, and on the image resized
to the planned size with HF's filter (do_resize=False) where vitserve caps what HF would overshoot.
Equality is exact (torch.equal): the fast path does HF's own arithmetic, one IEEE operation at a time.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2VLImageProcessorPil

from bench.workloads import jpeg_bytes, photo_like
from tests.checkpoints import make_checkpoint
from tests.imagegen import noise
from vitserve.families import FAMILIES
from vitserve.processors import load_image_processor
from vitserve.processors.hf_config import qwen_hf_processor
from vitserve.processors.pixels import FastPatches
from vitserve.processors.prepare import prepare_image
from vitserve.processors.qwen import QwenProcessor

QWEN = tuple(name for name, family in FAMILIES.items() if family.layout == "patches")


def hf_oracle(ref, proc: QwenProcessor, image: Image.Image, resize=None) -> torch.Tensor:
    """What HF itself makes of `image` under vitserve's plan (module docstring). `ref` is the PIL processor
    and `resize` PIL's resize by default; tests of the torch backend pass the torchvision processor and
    torchvision's resize (image, (width, height)) -> what `ref` takes with do_resize=False."""
    plan = proc.plan(*image.size)
    clamp = proc.geometry.clamped_max_pixels(proc.budget_tokens)
    size = {"shortest_edge": proc.geometry.min_pixels, "longest_edge": clamp}
    if plan.hf_native:
        out = ref(image, size=size, return_tensors="pt")
    else:
        resized = (resize or (lambda im, wh: im.resize(wh, resample=ref.resample)))(image, plan.resized_size)
        out = ref(resized, do_resize=False, return_tensors="pt")
    assert tuple(out["image_grid_thw"][0].tolist()) == plan.grid_thw
    pixels: torch.Tensor = out["pixel_values"]
    return pixels


def assert_fast_equals_hf(proc: QwenProcessor, ref: Qwen2VLImageProcessorPil, image: Image.Image) -> None:
    assert isinstance(proc.fast, FastPatches)  # else this would compare HF with HF
    got = proc.preprocess(image).pixel_values
    want = hf_oracle(ref, proc, image)
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixels")
    return {family: make_checkpoint(family, root / family) for family in QWEN}


# Sizes against the tiny checkpoints' limits (4 to 64 merged tokens): HF's round, shrink and grow branches,
# a thin image HF would overshoot, and sides that are not multiples of anything.
CHECKPOINT_CASES = [
    (0, (333, 217)),  # shrink to 64 tokens
    (0, (57, 113)),  # round
    (0, (9, 13)),  # grown to min_pixels
    (16, (500, 333)),  # clamped by the budget
    (16, (30, 1000)),  # HF overshoots in its shrink branch: capped by vitserve
    (6, (3, 50)),  # HF overshoots in its grow branch: vitserve fits the minimum
]


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize(("budget", "size"), CHECKPOINT_CASES)
def test_fast_path_equals_hf_on_checkpoint_configs(checkpoints, family, budget, size):
    ckpt = checkpoints[family]
    proc = load_image_processor(str(ckpt), budget, resize="pil")
    ref = AutoImageProcessor.from_pretrained(str(ckpt), backend="pil", local_files_only=True)
    assert_fast_equals_hf(proc, ref, noise(*size, seed=size[0] + budget))


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize(("budget", "size"), [(256, (1000, 700)), (1024, (640, 480)), (64, (200, 1900))])
def test_fast_path_equals_hf_on_published_defaults(family, budget, size):
    proc = load_image_processor(family, budget, resize="pil")
    assert_fast_equals_hf(proc, qwen_hf_processor(family, None), noise(*size, seed=budget))


@pytest.mark.parametrize("family", QWEN)
def test_every_value_of_every_channel(family):
    # 4 x 256 pixels per channel holding every uint8 value in a different order per channel, at a size the
    # processor keeps as it is: each entry of the lookup table is checked against HF's arithmetic.
    proc = load_image_processor(family, 0, resize="pil")
    side = proc.geometry.factor * 8
    rng = np.random.default_rng(7)
    pixels = np.stack([rng.permutation(np.resize(np.arange(256), side * side)) for _ in range(3)], axis=-1)
    image = Image.fromarray(pixels.reshape(side, side, 3).astype(np.uint8), "RGB")
    assert proc.plan(side, side).resized_size == (side, side)
    assert_fast_equals_hf(proc, qwen_hf_processor(family, None), image)


def test_photo_jpeg_through_prepare_image():
    # the production path: bytes -> decode -> preprocess, a photo-like JPEG clamped to 256 tokens
    data = jpeg_bytes(photo_like(1200, 900, seed=3))
    proc = load_image_processor("qwen2_5_vl", 256, resize="pil")
    prepared = prepare_image(data, proc, max_image_pixels=0)
    with Image.open(io.BytesIO(data)) as image:
        want = hf_oracle(qwen_hf_processor("qwen2_5_vl", None), proc, image.convert("RGB"))
    assert torch.equal(prepared.item.pixel_values, want)


SETTINGS = [
    {"do_normalize": False},  # rescaled only
    {"do_rescale": False},  # normalized uint8 values
    {"do_rescale": False, "do_normalize": False},  # raw values as float32
    {"rescale_factor": 1 / 127.5, "image_mean": [1.0, 0.5, 0.0], "image_std": [1.0, 0.3, 2.0]},
    {"image_mean": 0.5, "image_std": 0.25},  # scalars
    {"patch_size": 7},  # odd patch side: one value per lookup instead of two
    {"temporal_patch_size": 1},
    {"temporal_patch_size": 3, "merge_size": 1},
    {"resample": 2},  # bilinear
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_fast_path_equals_hf_for_other_settings(settings):
    params = {"min_pixels": 4 * 784, "max_pixels": 400 * 784, **settings}
    proc = QwenProcessor("qwen2_5_vl", Qwen2VLImageProcessorPil.from_dict(params), 100, "pil")
    ref = Qwen2VLImageProcessorPil.from_dict(params)
    for seed, size in enumerate([(333, 217), (31, 700), (10, 10)]):
        assert_fast_equals_hf(proc, ref, noise(*size, seed=seed))


def test_settings_the_fast_path_does_not_cover_keep_hf():
    params = {"min_pixels": 4 * 784, "max_pixels": 400 * 784, "do_resize": False}
    proc = QwenProcessor("qwen2_5_vl", Qwen2VLImageProcessorPil.from_dict(params), 0, "pil")
    assert proc.fast is None
    image = noise(56, 84, seed=1)  # already a multiple of the merge group: HF needs no resize
    want = Qwen2VLImageProcessorPil.from_dict(params)(image, return_tensors="pt")["pixel_values"]
    assert torch.equal(proc.preprocess(image).pixel_values, want)


def test_chunks_cover_the_whole_image():
    # more rows of merge groups than one chunk holds, and a last chunk that is not full
    proc = load_image_processor("qwen2_5_vl", 0, resize="pil")
    assert isinstance(proc.fast, FastPatches)
    pixels = np.asarray(noise(28 * 3, 28 * 400, seed=9))  # 400 rows of merge groups, 12 patches each
    patches = proc.fast.patchify(pixels)
    want = proc.hf(Image.fromarray(pixels), do_resize=False, return_tensors="np")["pixel_values"]
    assert np.array_equal(patches, want)
