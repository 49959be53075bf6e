"""The training transform: same pixels as torchvision's chain, crops inside the asked range, batching."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from mmssl.data.transforms import (
    OPENAI_MEAN,
    OPENAI_STD,
    BatchNormalize,
    RandomResizedCropFlip,
    to_uint8_tensor,
    train_transform,
)


def _photo(width: int = 40, height: int = 30, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_same_pixels_as_torchvision_for_the_same_crop(monkeypatch):
    image = _photo()
    box = (3, 5, 3 + 24, 5 + 20)  # left, top, right, bottom
    crop = RandomResizedCropFlip(16, scale=(0.2, 1.0))
    monkeypatch.setattr(crop, "crop_box", lambda w, h, rng=None: box)
    mine = BatchNormalize(OPENAI_MEAN, OPENAI_STD)(to_uint8_tensor(crop(image)))
    reference = TF.normalize(TF.to_tensor(TF.resized_crop(image, 5, 3, 20, 24, [16, 16], T.InterpolationMode.BICUBIC)),
                             OPENAI_MEAN, OPENAI_STD)
    assert mine.shape == reference.shape == (3, 16, 16)
    torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)


def test_crop_boxes_stay_inside_the_image_and_the_scale_range():
    random.seed(0)
    crop = RandomResizedCropFlip(16, scale=(0.3, 0.6))
    areas = []
    for _ in range(500):
        left, top, right, bottom = crop.crop_box(40, 30)
        assert 0 <= left < right <= 40 and 0 <= top < bottom <= 30
        areas.append((right - left) * (bottom - top) / (40 * 30))
        ratio = (right - left) / (bottom - top)
        assert 3 / 4 - 0.1 <= ratio <= 4 / 3 + 0.1  # rounding to whole pixels
    assert 0.25 <= min(areas) and max(areas) <= 0.65
    assert np.std(areas) > 0.05  # actually random


def test_a_sample_rng_decides_the_crop_and_flip_alone():
    image = _photo(40, 30)
    crop = RandomResizedCropFlip(16, scale=(0.2, 1.0), hflip=True)
    first = np.asarray(crop(image, random.Random("0/3/00007.tar/s00042")))
    random.seed(5)  # the module-level RNG plays no part once a sample RNG is given
    again = np.asarray(crop(image, random.Random("0/3/00007.tar/s00042")))
    other = [np.asarray(crop(image, random.Random(f"0/3/00007.tar/s{i:05d}"))) for i in range(8)]
    assert np.array_equal(first, again)
    assert not all(np.array_equal(first, o) for o in other)


def test_flip_happens_about_half_the_time_and_only_when_asked():
    image = _photo(16, 16)
    random.seed(1)
    flipping = RandomResizedCropFlip(16, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=True)
    outputs = [np.asarray(flipping(image)) for _ in range(200)]
    flipped = sum(np.array_equal(o, np.asarray(image)[:, ::-1]) for o in outputs)
    assert 70 < flipped < 130
    plain = RandomResizedCropFlip(16, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert all(np.array_equal(np.asarray(plain(image)), np.asarray(image)) for _ in range(20))


def test_grey_images_become_three_channels_and_bad_inputs_fail_clearly():
    grey = Image.fromarray(np.full((28, 28), 200, dtype=np.uint8), mode="L")
    out = train_transform(28, scale=(1.0, 1.0))(grey)
    assert out.shape == (3, 28, 28) and out.dtype == torch.float32
    expected = (200 / 255 - torch.tensor(OPENAI_MEAN)) / torch.tensor(OPENAI_STD)
    torch.testing.assert_close(out[:, 10, 10], expected, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="uint8"):
        BatchNormalize(OPENAI_MEAN, OPENAI_STD)(torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="std"):
        BatchNormalize(OPENAI_MEAN, (0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCropFlip(16, scale=(0.8, 0.2))
