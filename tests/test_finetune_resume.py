"""A fine-tune with Mixup / CutMix resumed from a mid-run checkpoint ends as if it had never stopped.

timm's ``Mixup`` draws its lambda, its Mixup-or-CutMix switch and the CutMix box from numpy's
global RNG in the training process; ``ImageClassifier.on_fit_start`` reseeds numpy per rank, and
``RNGState`` (always on via the CLI) must put the checkpoint's numpy stream back after that.
Drop path draws from torch's RNG, the crops, flips and random erasing in the loader workers.
Both runs go through the real CLI, in this interpreter (one process). With numpy reseeded after
``RNGState``'s restore (its stream lost, the rest kept), the resumed run's parameters end up to
4e-3 away from the uninterrupted run's: the test sees a lost Mixup stream.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from tests.cli_runs import run_one_process
from tests.test_finetune import CONFIGS, TINY, write_labelled
from tests.test_resume import _assert_same_params, _csv_entries

STEPS, EVERY = 9, 4  # 96 samples / batch 16: 6 steps an epoch, validation after step 6


def _args(tmp_path: Path, root: Path, train: str, val: str, ckpt: str = "") -> list[str]:
    overrides = {"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",  # steps 4 and 8, all kept
         "init_args": {"every_n_train_steps": EVERY, "save_top_k": -1, "dirpath": str(root / "mid")}},
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
        {"class_path": "tests.helpers.DumpParams", "init_args": {"folder": str(root / "params")}},
    ]}}
    path = tmp_path / f"{root.name}.yaml"
    path.write_text(yaml.safe_dump(overrides))
    return ["fit", "--config", str(CONFIGS / "demo.yaml"), *TINY, "--config", str(path),
            "--model.init_args.mixup=0.8", "--model.init_args.cutmix=1.0", "--model.init_args.blr=0.03",
            f"--data.init_args.train_data={train}", f"--data.init_args.val_data={val}",
            f"--trainer.max_steps={STEPS}", "--trainer.max_epochs=-1", "--trainer.log_every_n_steps=1",
            f"--trainer.default_root_dir={root}", *([f"--ckpt_path={ckpt}"] if ckpt else [])]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums in every run of this process
    yield
    torch.set_num_threads(threads)


def test_finetune_with_mixup_cutmix_resumes_exactly(tmp_path, one_thread):
    train = write_labelled(tmp_path / "train", [48, 48], 0)
    val = write_labelled(tmp_path / "val", [40], 1)
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run_one_process(_args(tmp_path, reference, train, val))
    # Step 4: mid epoch 0; the resumed run crosses the epoch's validation, which must not shift
    # the training streams either.
    ckpt = reference / "mid" / f"epoch=0-step={EVERY}.ckpt"
    assert "numpy" in torch.load(ckpt, weights_only=True)["callbacks"]["RNGState"]
    run_one_process(_args(tmp_path, resumed, train, val, str(ckpt)))
    _assert_same_params(resumed, reference)
    want = _csv_entries(reference / "version_0")
    got = _csv_entries(resumed / "version_0")  # a fresh run folder: the steps from the checkpoint on
    assert got == {k: n for k, n in want.items() if k[0] >= EVERY}, (
        sorted(set(want) - set(got))[:6], sorted(set(got) - set(want))[:6])
    with open(resumed / "version_0" / "metrics.csv", newline="") as f:
        losses = {int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert losses == set(range(EVERY, STEPS)) and any(k[1] == "val/top1" for k in got)
