"""A real image through the exported ``CLIPProcessor`` and through mmssl's eval transform: the same
pixels and the same embedding, so a transformers user sees what mmssl's evaluation saw."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmssl.data.transforms import eval_transform
from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]
# Measured on this image: bicubic (both pipelines) differs by one 8-bit level in 9 of the 3072
# normalised values (<= 1/255/std = 0.015, mean 4e-5) and by 2.7e-4 in the embedding; a bilinear
# processor moves 1795 values by more than 0.02 (mean 0.06) and the embedding by 0.05.
PIXEL_ATOL, PIXEL_MEAN_ATOL, EMBED_ATOL = 0.016, 1e-3, 2e-3


def _photo() -> Image.Image:
    """An 80x56 RGB picture with edges, gradients and texture (seeded), not square and not the
    model's 32 pixels, so the short-side resize and the centre crop both act."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:56, 0:80].astype(np.float32)
    red = 127 + 100 * np.sin(x / 3.0) * np.cos(y / 5.0)
    green = np.where((x // 7 + y // 7) % 2 == 0, 220.0, 30.0)  # a checkerboard: sharp edges
    blue = 255 * x / 79 + rng.normal(0, 20, (56, 80))
    pixels = np.stack([red, green, blue], axis=-1).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def _export_hf(ckpt: Path, output: Path) -> None:
    spec = importlib.util.spec_from_file_location("export_tool", REPO / "tools/export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--ckpt", str(ckpt), "--format", "hf", "--output", str(output)])


def test_clip_processor_gives_mmssls_eval_pixels_and_embedding(tmp_path, tiny_clip_json):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = CLIP(tiny_clip_json).eval()
    with torch.no_grad():  # weights off their init, so the embedding depends on every pixel
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, tmp_path / "last.ckpt")
    _export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    processor = transformers.CLIPProcessor.from_pretrained(str(tmp_path / "hf"))
    hf = transformers.CLIPModel.from_pretrained(str(tmp_path / "hf")).eval()

    photo = _photo()
    ours = eval_transform(model.image_size, model.image_mean, model.image_std)(photo)[None]  # (1, 3, 32, 32)
    theirs = processor(images=photo, return_tensors="pt")["pixel_values"]
    assert theirs.shape == ours.shape == (1, 3, 32, 32)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=PIXEL_ATOL)  # at most a rounding step apart
    assert (theirs - ours).abs().mean() < PIXEL_MEAN_ATOL  # ... and almost everywhere equal
    with torch.no_grad():
        mine = model.encode_image(ours, normalize=False)
        hf_image = hf.get_image_features(pixel_values=theirs)
        hf_image = getattr(hf_image, "pooler_output", hf_image)  # transformers 5: an output object
    torch.testing.assert_close(hf_image, mine, rtol=0, atol=EMBED_ATOL)
