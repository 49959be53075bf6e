"""Fine-tuning through the real ``mmssl`` CLI: recipes, learning on labelled shards, validate (2-process
DDP with validation on, rank 1 without a val batch: tests/data/test_folders.py).

The labelled shards are written here: four colour classes of noisy 16x16 PNGs, with ``cls``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmssl.cli import cli_main
from mmssl.models import ImageClassifier
from tests.cli_runs import REPO, last_metrics, run_mmssl
from tests.data.shard_helpers import write_tar

CONFIGS = REPO / "configs" / "finetune"
COLOURS = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30))
TINY = [
    "--model.init_args.num_classes=4", "--model.init_args.image_size=16",
    '--model.init_args.model_kwargs={"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2}',
    "--data.init_args.batch_size=16", "--data.init_args.num_workers=1",
    "--trainer.enable_progress_bar=false",
]


def write_labelled(folder: Path, shards: list[int], seed: int) -> str:
    """Shards of noisy colour squares, label = colour; returns the folder."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    index, sizes = 0, {}
    for s, count in enumerate(shards):
        members = []
        for _ in range(count):
            label = index % len(COLOURS)
            pixels = np.clip(np.array(COLOURS[label]) + rng.integers(-60, 61, (16, 16, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            members += [(f"s{index:05d}.png", buf.getvalue()), (f"s{index:05d}.cls", str(label).encode())]
            index += 1
        write_tar(folder / f"{s:05d}.tar", members)
        sizes[f"{s:05d}.tar"] = count
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return str(folder)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("labelled")
    return write_labelled(root / "train", [48, 48], 0), write_labelled(root / "val", [40], 1)


SIZES = {"vit_base_patch16": (0.65, 0.1, 5e-4, 100), "vit_large_patch16": (0.75, 0.2, 1e-3, 50),
         "vit_huge_patch14": (0.75, 0.3, 1e-3, 50)}  # FINETUNE.md: layer decay, drop path, blr, epochs


@pytest.mark.parametrize("name", sorted(SIZES))
def test_recipes_state_mae_finetune_values_and_build(name):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    assert (model["layer_decay"], model["drop_path_rate"], model["blr"], trainer["max_epochs"]) == SIZES[name]
    assert data["batch_size"] * trainer["devices"] * trainer["num_nodes"] * trainer["accumulate_grad_batches"] == 1024
    assert (model["weight_decay"], model["mixup"], model["cutmix"], model["label_smoothing"]) == (0.05, 0.8, 1.0, 0.1)
    assert (model["warmup_epochs"], model["min_lr"], model["global_pool"]) == (5, 1e-6, "avg")
    assert data["train_augment"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and data["train_augment"]["re_prob"] == 0.25
    assert data["eval_crop_pct"] == 0.875
    with torch.device("meta"):  # shapes only: ViT-H has 630M parameters
        module = ImageClassifier(**{k: v for k, v in model.items() if k not in ("optimizer", "init_encoder")})
    assert module.model.patch_embed.num_patches == (224 // int(name[-2:])) ** 2


def test_finetune_learns_and_validate_reproduces_its_figures(labelled, tmp_path):
    train, val = labelled
    common = ["--config", str(CONFIGS / "demo.yaml"), *TINY, f"--data.init_args.train_data={train}",
              f"--data.init_args.val_data={val}", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    start = cli_main(["validate", *common]).trainer.callback_metrics  # the initial weights (same seed)
    out = run_mmssl(["fit", *common, "--trainer.max_epochs=4", "--model.init_args.blr=0.03"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    runs = sorted((tmp_path / "runs").glob("version_*"))
    fitted = last_metrics(runs[-1])
    assert fitted["val/top1"] >= float(start["val/top1"]) + 0.25, (fitted, start)
    assert fitted["val/top5"] == 1.0  # 4 classes: top-5 is every class
    again = cli_main(["validate", *common, f"--ckpt_path={runs[-1] / 'checkpoints' / 'last.ckpt'}"])
    for key in ("val/top1", "val/loss"):
        assert float(again.trainer.callback_metrics[key]) == pytest.approx(fitted[key], rel=1e-5), key


def test_the_long_fashion_mnist_stack_keeps_the_recipe_and_scores_the_ema(labelled, tmp_path, capsys):
    """configs/finetune/fashion_mnist_long.yaml (the 30-epoch run of docs/results.md) stacks onto
    the fine-tuning recipe: its schedule, the light augmentation and the EMA, the recipe's other
    values kept; a short run through it scores the EMA beside the raw weights after each epoch."""
    stack = ["--config", str(CONFIGS / "fashion_mnist.yaml"), "--config", str(CONFIGS / "fashion_mnist_long.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *stack, "--print_config"])
    assert exit_info.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    model, data, trainer = cfg["model"]["init_args"], cfg["data"]["init_args"], cfg["trainer"]
    assert (trainer["max_steps"], trainer["max_epochs"], trainer["val_check_interval"]) == (
        30 * (60000 // 128),
        30,
        1.0,
    )
    assert model["warmup_steps"] == round(0.05 * trainer["max_steps"])
    assert (model["mixup"], model["cutmix"], data["train_augment"]) == (0.0, 0.0, None)
    assert (model["blr"], model["layer_decay"], model["label_smoothing"], model["drop_path_rate"]) == (
        2e-3,
        0.75,
        0.1,
        0.1,
    )
    assert (data["crop_scale"], data["hflip"], data["batch_size"]) == ([0.5, 1.0], True, 128)
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    assert (
        set(callbacks) == {"ModelCheckpoint", "LearningRateMonitor", "EMA"}
        and callbacks["ModelCheckpoint"]["save_last"]
    )
    assert (callbacks["EMA"]["decay"], callbacks["EMA"]["warmup_power"], callbacks["EMA"]["evaluate"]) == (
        0.999,
        0.75,
        "both",
    )

    train, val = labelled  # 96 training samples: 6 steps of 16 an epoch
    cli = cli_main(["fit", *stack, *TINY, f"--data.init_args.train_data={train}", f"--data.init_args.val_data={val}",
                    "--trainer.max_steps=12", "--trainer.max_epochs=2", "--model.init_args.warmup_steps=2",
                    "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path / 'runs'}"])
    assert cli.trainer.global_step == 12
    [run] = sorted((tmp_path / "runs").glob("version_*"))
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    scored = [
        (r["step"], r["val/top1"], r["val/top1_ema"]) for r in rows if r.get("val/top1") and r.get("val/top1_ema")
    ]
    assert [s for s, _, _ in scored] == ["5", "11"], scored  # after each of the 2 epochs, both weights
    assert (run / "checkpoints" / "last.ckpt").is_file()
