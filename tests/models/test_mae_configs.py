"""The MAE recipes state the paper's hyper-parameters and build valid models (on the meta device)."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml

from mmssl.cli import main
from mmssl.models.mae import MAE

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SIZES = {  # MAE Table 8 / timm: patch, width, depth, heads
    "vit_base_patch16": (16, 768, 12, 12),
    "vit_large_patch16": (16, 1024, 24, 16),
    "vit_huge_patch14": (14, 1280, 32, 16),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_recipe_matches_paper(name):
    cfg = yaml.safe_load((CONFIGS / "mae" / f"{name}.yaml").read_text())
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    assert (model["patch_size"], model["embed_dim"], model["depth"], model["num_heads"]) == SIZES[name]
    assert (model["decoder_embed_dim"], model["decoder_depth"], model["decoder_num_heads"]) == (512, 8, 16)
    assert model["mask_ratio"] == 0.75 and model["norm_pix_loss"] is True and model["blr"] == 1.5e-4
    opt = model["optimizer"]
    assert opt["class_path"] == "torch.optim.AdamW"
    assert opt["init_args"]["betas"] == [0.9, 0.95] and opt["init_args"]["weight_decay"] == 0.05
    global_batch = data["batch_size"] * trainer["devices"] * trainer["num_nodes"] * trainer["accumulate_grad_batches"]
    assert global_batch == 4096
    steps_per_epoch = -(-data["train_num_samples"] // global_batch)
    assert trainer["max_steps"] == 800 * steps_per_epoch and model["warmup_steps"] == 40 * steps_per_epoch
    assert data["crop_scale"] == [0.2, 1.0] and data["hflip"] is True
    with torch.device("meta"):  # shapes only: ViT-H has 630M parameters
        mae = MAE(**{k: v for k, v in model.items() if k != "optimizer"})
    assert mae.encoder.num_patches == (224 // SIZES[name][0]) ** 2


def test_demo_recipe_builds():
    cfg = yaml.safe_load((CONFIGS / "demo" / "mae.yaml").read_text())
    model = MAE(**{k: v for k, v in cfg["model"]["init_args"].items() if k != "optimizer"})
    assert model.image_size == 32 and sum(p.numel() for p in model.parameters()) < 2_000_000


@pytest.mark.parametrize("name", sorted(SIZES))
def test_recipe_runs_two_steps_on_cpu_at_tiny_scale(name, tmp_path, tiny_demo):
    main([
        "fit", "--config", str(CONFIGS / "mae" / f"{name}.yaml"),
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1",
        "--trainer.strategy=auto", "--trainer.precision=32-true", "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
        "--data.train_data=null", f"--data.demo_dir={tiny_demo.root}",
        "--data.batch_size=4", "--data.num_workers=0",
        "--data.train_num_samples=64", "--model.image_size=32", "--model.patch_size=4",
        "--model.embed_dim=64", "--model.depth=1", "--model.num_heads=4",
        "--model.decoder_embed_dim=32", "--model.decoder_depth=1", "--model.decoder_num_heads=4",
        "--trainer.log_every_n_steps=1",
    ])
    [run] = sorted(tmp_path.glob("version_*"))
    with open(run / "metrics.csv", newline="") as f:
        losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(losses) == [0, 1]  # both optimizer steps ran and logged their loss
    assert all(math.isfinite(v) and v > 0 for v in losses.values()), losses
