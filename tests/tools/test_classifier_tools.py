"""The checkpoint tools on a fine-tuned ``ImageClassifier`` checkpoint written by ``mmssl fit``:
linear probe (final and per-block features), attention maps; zero-shot and the similarity map
refuse it (no text tower)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmssl.checkpoints import read_checkpoint
from mmssl.cli import main
from mmssl.evaluation.encoders import load_model
from mmssl.models import ImageClassifier
from tests.models.test_finetune import CONFIGS, TINY, write_labelled
from tests.tools.test_viz_tools import pngs, run_tool


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> dict:
    """Labelled shards and the checkpoint of a 2-step fine-tune of the tiny ViT on them."""
    root = tmp_path_factory.mktemp("finetuned")
    train, val = write_labelled(root / "train", [48, 48], 0), write_labelled(root / "val", [40], 1)
    main(["fit", "--config", str(CONFIGS / "demo.yaml"), *TINY, f"--data.init_args.train_data={train}",
          f"--data.init_args.val_data={val}", "--trainer.max_steps=2", "--trainer.limit_val_batches=1",
          f"--trainer.default_root_dir={root / 'runs'}"])
    return {"train": train, "val": val, "ckpt": root / "runs" / "version_0" / "checkpoints" / "last.ckpt"}


def test_a_finetuned_checkpoint_loads_as_the_classifier_it_names(finetuned):
    checkpoint = read_checkpoint(str(finetuned["ckpt"]))
    # LightningCLI records the class path the recipe gives: the package's public one.
    assert checkpoint["hyper_parameters"]["_class_path"] == "mmssl.models.ImageClassifier"
    model = load_model(str(finetuned["ckpt"]))
    assert type(model) is ImageClassifier and not model.training
    for key, value in model.state_dict().items():  # the fine-tuned weights, head included
        assert torch.equal(value, checkpoint["state_dict"][key]), key
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        tokens = model.forward_features(images)
        assert tokens.shape == (3, 1 + 16, 32)  # cls + 4x4 patches
        blocks = model.forward_intermediates(images, pool="avg")
        assert len(blocks) == 2 and blocks[0].shape == (3, 32)
        # Under global pooling the embedding is fc_norm of the mean patch token: what the head reads.
        embedding = model.encode_image(images)
        torch.testing.assert_close(embedding, model.model.fc_norm(tokens[:, 1:].mean(dim=1)))
        torch.testing.assert_close(model.model.head(embedding), model(images))


def test_linear_probe_tool_on_a_finetuned_checkpoint(finetuned, tmp_path, monkeypatch):
    out = tmp_path / "probe.json"
    assert run_tool("linear_probe.py", [
        "--ckpt", str(finetuned["ckpt"]), "--train-data", finetuned["train"], "--val-data", finetuned["val"],
        "--feature", "embedding", "--all-layers", "--knn-k", "5", "--output-json", str(out),
    ], monkeypatch) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "ImageClassifier" and report["feature"] == "embedding" and report["feature_dim"] == 32
    assert (report["num_train"], report["num_val"], report["num_classes"]) == (96, 40, 4)
    assert [layer["block"] for layer in report["layers"]] == [1, 2]
    # Four colours with noise: linearly separable from any ViT's features, fine-tuned for 2 steps or not.
    assert report["top1"] >= 0.9 and 0 <= report["knn_top1"] <= 1


def test_attention_maps_tool_on_a_finetuned_checkpoint(finetuned, tmp_path, monkeypatch):
    paths = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        pixels = np.clip(np.array(colour) + np.random.default_rng(i).integers(-60, 61, (24, 24, 3)), 0, 255)
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(pixels.astype(np.uint8)).save(paths[-1])
    assert run_tool("attention_maps.py", ["--ckpt", str(finetuned["ckpt"]), "--images", *paths,
                                          "--output", str(tmp_path / "out")], monkeypatch) == 0
    written = pngs(tmp_path / "out")
    assert [Path(p).name for p in written] == ["img0_attention.png", "img1_attention.png"]
    assert all(Image.open(p).format == "PNG" for p in written)


def test_text_tools_refuse_a_finetuned_checkpoint(finetuned, tmp_path, monkeypatch, capsys):
    ckpt = str(finetuned["ckpt"])
    assert run_tool("zero_shot.py", ["--ckpt", ckpt, "--data", finetuned["val"]], monkeypatch) == 1
    assert capsys.readouterr().err.startswith(f"zero_shot: {ckpt}: ImageClassifier has no text tower")
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(image)
    assert run_tool("similarity_map.py", ["--ckpt", ckpt, "--images", str(image), "--text", "a",
                                          "--output", str(tmp_path / "sim")], monkeypatch) == 1
    assert capsys.readouterr().err.startswith(f"similarity_map: {ckpt}: ImageClassifier is not a CLIP")
