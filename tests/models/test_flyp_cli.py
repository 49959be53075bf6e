"""FLYP in one command: configs/finetune/clip_flyp_demo.yaml fine-tunes a CLIP started from
model.pretrained (an open_clip export) on the demo set's labels, captions from its class names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.load import load_lightning
from mmssl.models.clip import CLIP
from tests.cli_runs import run_one_process

REPO = Path(__file__).resolve().parents[2]


def test_the_flyp_recipe_starts_from_the_pretrained_clip_and_trains_on_class_captions(
    tiny_demo, tiny_clip_json, tmp_path
):
    torch.manual_seed(0)
    start = CLIP(tiny_clip_json)
    torch.save(
        start.model.state_dict(), tmp_path / "start_open_clip.pt"
    )  # what tools/export.py --format open_clip writes
    run_one_process(
        [
            "fit",
            "--config",
            str(REPO / "configs/finetune/clip_flyp_demo.yaml"),
            "--model.init_args.model_name",
            tiny_clip_json,
            "--model.init_args.pretrained",
            str(tmp_path / "start_open_clip.pt"),
            "--data.init_args.demo_dir",
            tiny_demo.root,
            "--data.init_args.captions_from_classes",
            str(Path(tiny_demo.root) / "classnames.txt"),
            "--data.init_args.batch_size",
            "8",
            "--data.init_args.num_workers",
            "0",
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
        ]
    )
    tuned = load_lightning(str(next((tmp_path / "runs").rglob("last.ckpt"))))
    moved = max(
        float((a - b).abs().max())
        for a, b in zip(tuned.model.state_dict().values(), start.model.state_dict().values())
        if a.is_floating_point()
    )
    assert 0 < moved < 1e-3  # two steps at lr 2e-5 from the pretrained weights, not from a fresh init


def test_model_pretrained_takes_an_mmssl_clip_checkpoint(tiny_clip_json, tmp_path):
    torch.manual_seed(1)
    start = CLIP(tiny_clip_json, init_logit_scale=1.5)
    torch.save({"state_dict": start.state_dict(), "hyper_parameters": dict(start.hparams)}, tmp_path / "start.ckpt")
    loaded = CLIP(tiny_clip_json, pretrained=str(tmp_path / "start.ckpt"))
    for key, value in start.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    other = json.loads(Path(tiny_clip_json).read_text())
    other["text_cfg"]["width"] = 48
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(RuntimeError, match="size mismatch"):
        CLIP(str(tmp_path / "other.json"), pretrained=str(tmp_path / "start.ckpt"))
