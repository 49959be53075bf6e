"""Each CLIP recipe loads and trains a few steps on CPU, stacked with configs/clip/tiny_cpu.yaml."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from mmssl.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["vit_b32", "vit_b16", "siglip_vit_b16", "flip_vit_b16"]


def _rows(run: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(run / "metrics.csv")))


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_a_few_steps_on_cpu(tmp_path, tiny_demo, recipe):
    main([
        "fit", "--config", str(REPO / f"configs/clip/{recipe}.yaml"),
        "--config", str(REPO / "configs/clip/tiny_cpu.yaml"),
        f"--model.init_args.model_name={REPO / 'configs/models/clip_micro.json'}",
        # The tiny demo's shards by path: 64 pairs / 16 = 4 steps per epoch, 32 held out.
        f"--data.init_args.train_data={tiny_demo.train}", f"--data.init_args.val_data={tiny_demo.val}",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ])
    (run,) = tmp_path.glob("version_*")
    rows = _rows(run)
    losses = _column(rows, "train/loss")
    assert len(losses) == 6 and all(v == v for v in losses)  # 6 finite steps
    for key in ("val/loss", "val/i2t_R@1", "val/i2t_R@5", "val/i2t_R@10", "val/t2i_R@1"):
        assert _column(rows, key), f"{key} not logged"
    assert 0.0 <= _column(rows, "val/i2t_R@1")[-1] <= _column(rows, "val/i2t_R@10")[-1] <= 1.0
    mask = _column(rows, "train/image_mask_ratio")
    if recipe.startswith("flip"):  # 4 masked steps, then the unmasked tuning phase (2 steps)
        assert mask == [0.5] * 4 + [0.0] * 2
        # Masked: 2 warm-up steps, cosine over the other 2; tuning: its own cosine at 1% of the peak.
        lrs = _column(rows, "lr-AdamW/pg1")
        assert lrs == pytest.approx([x * 1.024e-3 for x in (0.5, 1.0, 1.0, 0.5, 0.01, 0.005)])
    else:
        assert set(mask) == {0.0}
    if recipe.startswith("siglip"):
        assert _column(rows, "train/logit_bias")[0] == pytest.approx(-10.0, abs=0.05)
