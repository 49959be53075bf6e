"""The full-size M3AE and CLIP + MLM + ITM recipes state their authors' values, build (on the meta
device) and train two steps at tiny scale through ``mmssl fit``."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml

from mmssl.cli import main
from mmssl.models.m3ae import M3AE
from mmssl.optim import param_groups

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
M3AE_SIZES = {"vit_base_patch16": (768, 12, 12), "vit_large_patch16": (1024, 24, 16)}  # model.py base / large


def _recipe(path: str) -> tuple[dict, dict, dict]:
    cfg = yaml.safe_load((CONFIGS / path).read_text())
    return cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]


def _global_batch(data: dict, trainer: dict) -> int:
    return data["batch_size"] * trainer["devices"] * trainer["num_nodes"] * trainer.get("accumulate_grad_batches", 1)


@pytest.mark.parametrize("name", sorted(M3AE_SIZES))
def test_m3ae_recipe_is_the_authors(name):
    model, data, trainer = _recipe(f"m3ae/{name}.yaml")
    assert (model["embed_dim"], model["depth"], model["num_heads"]) == M3AE_SIZES[name]
    assert (model["decoder_embed_dim"], model["decoder_depth"], model["decoder_num_heads"]) == (512, 8, 16)
    assert (model["image_size"], model["patch_size"], model["text_length"]) == (256, 16, 64)
    assert model["image_mask_ratio"] == model["text_mask_ratio"] == 0.75 and model["text_loss_weight"] == 0.5
    assert model["norm_pix_loss"] is True and model["blr"] == 1.5e-4 and model["min_lr_ratio"] == 0.0
    opt = model["optimizer"]["init_args"]
    assert opt["betas"] == [0.9, 0.95] and opt["weight_decay"] == 0.05
    assert _global_batch(data, trainer) == 4096
    per_epoch = -(-data["train_num_samples"] // 4096)
    assert trainer["max_steps"] == 100 * per_epoch and model["warmup_steps"] == 5 * per_epoch
    assert data["crop_scale"] == [0.2, 1.0] and data["hflip"] is True
    with torch.device("meta"):
        m3ae = M3AE(**{k: v for k, v in model.items() if k != "optimizer"})
    # The authors' no-decay list: cls token, type and mask embeddings, the token embedding, biases;
    # LayerNorm scales and the weight matrices decay.
    names = {id(p): n for n, p in m3ae.named_parameters()}
    decayed, plain = ({names[id(p)] for p in g["params"]} for g in param_groups(m3ae, m3ae.no_weight_decay,
                                                                              m3ae._param_ndim))
    assert {"encoder.cls_token", "image_type", "decoder_text_type", "mm_decoder.mask_token", "token_embed.weight",
            "encoder.blocks.0.attn.qkv.bias", "text_pred.bias"} <= plain
    assert {"encoder.norm.weight", "encoder.blocks.0.attn.qkv.weight", "text_pred.weight"} <= decayed


def test_clip_mlm_recipe_is_albefs():
    model, data, trainer = _recipe("clip_mlm/vit_b16.yaml")
    assert (model["mlm_weight"], model["itm_weight"], model["mlm_mask_ratio"]) == (1.0, 1.0, 0.15)
    assert (model["mlm_mask_share"], model["mlm_random_share"]) == (0.8, 0.1)
    opt = model["optimizer"]["init_args"]
    assert (opt["lr"], opt["weight_decay"], opt["betas"]) == (1.0e-4, 0.02, [0.9, 0.999])
    assert model["warmup_steps"] == 2000 and model["min_lr_ratio"] == 0.1  # min_lr 1e-5 of lr 1e-4
    assert _global_batch(data, trainer) == 512
    assert trainer["max_steps"] == 30 * -(-data["train_num_samples"] // 512)
    assert data["crop_scale"] == [0.2, 1.0] and data["hflip"] is True
    towers = yaml.safe_load((CONFIGS.parent / model["model_name"]).read_text())
    assert towers["embed_dim"] == 256 and towers["vision_cfg"]["image_size"] == 256
    assert towers["text_cfg"]["no_causal_mask"] is True and towers["text_cfg"]["vocab_size"] == 49408 + 1


def _two_steps(args: list[str], root: Path) -> dict[int, float]:
    main(["fit", *args, "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1",
          "--trainer.strategy=auto", "--trainer.precision=32-true", "--trainer.max_steps=2",
          "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={root}",
          "--trainer.enable_progress_bar=false", "--data.train_data=null", "--data.batch_size=4",
          "--data.num_workers=0", "--data.train_num_samples=64"])
    [run] = sorted(root.glob("version_*"))
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.mark.parametrize("recipe", ["m3ae/vit_large_patch16", "clip_mlm/vit_b16"])
def test_the_recipe_trains_two_steps_on_cpu_at_tiny_scale(recipe, tmp_path, tiny_demo, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the recipe names its towers' JSON relative to the repository
    tiny = (["--model.image_size=32", "--model.patch_size=4", "--model.embed_dim=32", "--model.depth=1",
             "--model.num_heads=2", "--model.decoder_embed_dim=16", "--model.decoder_depth=1",
             "--model.decoder_num_heads=2", "--model.text_length=16", "--model.warmup_steps=1"]
            if recipe.startswith("m3ae") else
            [f"--model.model_name={CONFIGS / 'models' / 'clip_mlm_tiny.json'}", "--model.warmup_steps=1"])
    losses = _two_steps(["--config", str(CONFIGS / f"{recipe}.yaml"), *tiny, f"--data.demo_dir={tiny_demo.root}"],
                        tmp_path)
    assert sorted(losses) == [0, 1] and all(math.isfinite(v) and v > 0 for v in losses.values()), losses
