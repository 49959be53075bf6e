"""Reduced-size JPEG decode keeps the crop law of a full decode; uint8 batches normalised after the transfer."""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from PIL import Image
from scipy import stats
from torchvision import transforms as T

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.decode import REDUCED_FROM, draft_size, open_image
from mmssl.data.transforms import RandomResizedCropFlip, to_uint8_tensor
from tests.data.shard_helpers import count_tokenizer


def _jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A smooth photo-like JPEG (bicubic from 6x6 random colours)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(coarse).resize((width, height), Image.BICUBIC).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


class _Recording(RandomResizedCropFlip):
    """Records each crop box as fractions of the image it was drawn on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boxes: list[tuple[float, float, float, float]] = []

    def crop_box(self, width, height, rng=None):
        box = super().crop_box(width, height, rng)
        self.boxes.append((box[0] / width, box[1] / height, box[2] / width, box[3] / height))
        return box


def test_reduced_decode_draws_the_full_images_crops():
    data = _jpeg(517, 389)  # sides not divisible by the reduction
    reduced = open_image(data, draft_size(64, 0.2))  # 144 px: libjpeg decodes at 1/2
    full = open_image(data)
    assert full.size == (517, 389) and reduced.size == (259, 195)
    assert reduced.info[REDUCED_FROM] == (517, 389, 2.0) and REDUCED_FROM not in full.info
    on_reduced, on_full = _Recording(64, (0.2, 1.0), hflip=True), _Recording(64, (0.2, 1.0), hflip=True)
    psnrs = []
    for i in range(20):
        a = to_uint8_tensor(on_reduced(reduced, random.Random(i))).float()
        b = to_uint8_tensor(on_full(full, random.Random(i))).float()
        psnrs.append(10 * torch.log10(255**2 / ((a - b) ** 2).mean()).item())
    # The same draws give the same box, on the stored image's grid, and the same flips.
    assert on_reduced.boxes == on_full.boxes
    assert min(psnrs) > 30.0  # the same picture, resampled from a half-size decode


def test_reduced_decode_crop_law_matches_torchvision_on_the_full_image():
    """Areas, aspect ratios, positions and flips of crops from a 1/2 decode follow torchvision's
    RandomResizedCrop + RandomHorizontalFlip on the stored image (two-sample KS tests, seeded)."""
    data = _jpeg(512, 384)
    reduced = open_image(data, draft_size(224, 0.08))  # 792 px > 384: no reduction...
    assert REDUCED_FROM not in reduced.info
    reduced = open_image(data, draft_size(64, 0.2))  # 144 px: 1/2 decode
    assert reduced.info[REDUCED_FROM][2] == 2.0
    crop = _Recording(64, (0.2, 1.0), hflip=True)
    plain = RandomResizedCropFlip(64, (0.2, 1.0))
    n, flips = 1500, 0
    for i in range(n):
        out = np.asarray(crop(reduced, random.Random(f"seed/{i}")))
        unflipped = np.asarray(plain(reduced, random.Random(f"seed/{i}")))  # same draws, no flip
        assert out.shape == (64, 64, 3)
        flips += np.array_equal(out, unflipped[:, ::-1]) and not np.array_equal(out, unflipped)
    torch.manual_seed(0)
    ref, ref_flips = [], 0
    for _ in range(n):
        top, left, h, w = T.RandomResizedCrop.get_params(Image.new("RGB", (512, 384)), (0.2, 1.0), (3 / 4, 4 / 3))
        ref.append((left / 512, top / 384, (left + w) / 512, (top + h) / 384))
        ref_flips += bool(torch.rand(1) < 0.5)

    def law(boxes):
        b = np.asarray(boxes)
        w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
        return {"area": w * h, "log_aspect": np.log(w * 512 / (h * 384)), "centre_x": (b[:, 0] + b[:, 2]) / 2,
                "centre_y": (b[:, 1] + b[:, 3]) / 2}

    mine, theirs = law(crop.boxes), law(ref)
    for key in mine:
        assert stats.ks_2samp(mine[key], theirs[key]).pvalue > 0.01, key
    assert 0.2 - 0.01 <= mine["area"].min() and mine["area"].max() <= 1.0
    assert abs(flips / n - 0.5) < 0.05 and abs(ref_flips / n - 0.5) < 0.05


def _datamodule(folder, **kwargs) -> ImageTextDataModule:
    return ImageTextDataModule(train_data=str(folder), batch_size=4, num_workers=1, image_size=16,
                               tokenizer=count_tokenizer, crop_scale=(0.5, 1.0), hflip=True, **kwargs)


def test_uint8_batches_normalised_after_transfer_equal_todays(tmp_path):
    from tests.data.shard_helpers import write_dataset

    write_dataset(tmp_path / "shards", [8, 8])
    today = _datamodule(tmp_path / "shards")
    assert not today._normalizes_on_device()  # no trainer: the CPU order (normalised in the worker)
    device = _datamodule(tmp_path / "shards", normalize_on_device=True)
    for a, b in zip(today.train_dataloader(), device.train_dataloader()):
        a = today.on_after_batch_transfer(today.on_before_batch_transfer(a, 0), 0)
        b = device.on_before_batch_transfer(b, 0)
        assert a["image"].dtype == torch.float32 and b["image"].dtype == torch.uint8  # a quarter of the bytes
        b = device.on_after_batch_transfer(b, 0)
        torch.testing.assert_close(b["image"], a["image"], atol=1e-6, rtol=1e-6)
        assert torch.equal(a["text"], b["text"])


def test_uint8_ships_by_default_only_when_the_device_is_not_the_cpu(tmp_path):
    from types import SimpleNamespace

    from mmssl.data.transforms import BatchNormalize

    dm = _datamodule(tmp_path)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert dm._normalizes_on_device() and dm._decoder(True).batch_transform is None
    dm.trainer.strategy.root_device = torch.device("cpu")  # measured: the CPU keeps normalising in the worker
    assert not dm._normalizes_on_device() and isinstance(dm._decoder(True).batch_transform, BatchNormalize)
    assert _datamodule(tmp_path, normalize_on_device=False)._decoder(True).batch_transform is not None
