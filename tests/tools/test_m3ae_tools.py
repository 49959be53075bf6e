"""An M3AE checkpoint through the image tools an MAE checkpoint takes (docs/models.md says its
encoder runs every probe and attention map): the per-block linear probe (``--all-layers``) and
the attention maps, on its image encoder alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmssl.models.m3ae import M3AE
from tests.cli_runs import run_tool

TINY_M3AE = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
                 decoder_depth=1, decoder_num_heads=2, text_length=16)


def _m3ae_file(path: Path) -> Path:
    """What ``mmssl fit`` saves, reduced to what the tools read: weights and hyper-parameters."""
    torch.manual_seed(0)
    module = M3AE(**TINY_M3AE)
    torch.save({"state_dict": module.state_dict(),
                "hyper_parameters": {**dict(module.hparams), "_class_path": "mmssl.models.m3ae.M3AE"}}, path)
    return path


def test_an_m3ae_checkpoint_takes_the_per_block_probe_and_the_attention_maps(tiny_demo, tmp_path, monkeypatch):
    ckpt = _m3ae_file(tmp_path / "m3ae.ckpt")
    out = tmp_path / "probe.json"
    assert run_tool("linear_probe.py", [
        "--ckpt", str(ckpt), "--train-data", tiny_demo.train, "--val-data", tiny_demo.eval_dir,
        "--all-layers", "--output-json", str(out),
    ], monkeypatch) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "M3AE" and report["feature_dim"] == 32
    assert [layer["block"] for layer in report["layers"]] == [1, 2]  # one figure per encoder block
    assert all(0 <= layer["top1"] <= 1 for layer in report["layers"]) and 0 <= report["top1"] <= report["top5"] <= 1
    images = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        pixels = np.clip(np.array(colour) + np.random.default_rng(i).integers(-60, 61, (40, 32, 3)), 0, 255)
        images.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(pixels.astype(np.uint8)).save(images[-1])
    assert run_tool("attention_maps.py", ["--ckpt", str(ckpt), "--images", *images, "--output", str(tmp_path / "maps")],
                    monkeypatch) == 0
    written = sorted((tmp_path / "maps").rglob("*.png"))
    assert [p.name for p in written] == ["img0_attention.png", "img1_attention.png"]
    assert all(Image.open(p).format == "PNG" for p in written)
