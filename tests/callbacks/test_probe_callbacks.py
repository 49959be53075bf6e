"""Linear-probe, k-NN and zero-shot callbacks on a tiny CLIP through a real Trainer."""

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from mmssl.callbacks import KNNProbe, LinearProbe, ZeroShot
from mmssl.data.datamodule import ImageTextDataModule
from mmssl.models.clip import CLIP


@pytest.fixture(scope="module")
def validated(tiny_demo, tiny_clip_json, tmp_path_factory):
    """One ``validate`` with all three callbacks (layer-wise probe on), as ``mmssl validate`` runs."""
    torch.manual_seed(0)
    model = CLIP(tiny_clip_json)
    data = ImageTextDataModule(
        train_data=tiny_demo.train, val_data=tiny_demo.val, batch_size=16, num_workers=0,
        train_num_samples=64, image_size=32, tokenizer=model.tokenizer,
    )
    kw = {"train_data": tiny_demo.train, "val_data": tiny_demo.eval_dir, "batch_size": 32}
    callbacks = [LinearProbe(layers=True, **kw), KNNProbe(**kw), ZeroShot(data=tiny_demo.eval_dir)]
    root = tmp_path_factory.mktemp("probe_run")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", logger=TensorBoardLogger(str(root), name=""),
        callbacks=list(callbacks), limit_val_batches=1, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.validate(model, datamodule=data, verbose=False)
    return trainer, model, callbacks


def test_validate_logs_every_probe(validated):
    trainer, _, _ = validated
    metrics = trainer.callback_metrics
    for key in ("probe/linear_top1", "probe/linear_top5", "probe/knn_top1", "val/zero_shot_top1",
                "probe/linear_top1_block1"):
        assert key in metrics and 0.0 <= float(metrics[key]) <= 1.0, key
    assert float(metrics["probe/linear_top1"]) <= float(metrics["probe/linear_top5"])
    pngs = list((trainer.log_dir and __import__("pathlib").Path(trainer.log_dir) / "probe").glob("layers_*.png"))
    assert len(pngs) == 1


def test_callbacks_leave_training_state_untouched(validated):
    trainer, model, callbacks = validated
    model.train()
    model.model.transformer.eval()  # e.g. a locked text tower, deliberately in eval
    model.model.logit_scale.requires_grad_(False)
    modes = {name: m.training for name, m in model.named_modules()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    for callback in callbacks:
        callback.evaluate(trainer, model)
    assert modes == {name: m.training for name, m in model.named_modules()}
    assert grads == {name: p.requires_grad for name, p in model.named_parameters()}
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.is_grad_enabled()


def test_linear_probe_runs_during_fit_every_n_epochs(tiny_demo, tiny_clip_json, tmp_path):
    model = CLIP(tiny_clip_json, warmup_steps=1)
    data = ImageTextDataModule(
        train_data=tiny_demo.train, val_data=tiny_demo.val, batch_size=16, num_workers=0,
        train_num_samples=32, image_size=32, tokenizer=model.tokenizer,
    )
    probe = LinearProbe(train_data=tiny_demo.train, val_data=tiny_demo.eval_dir, every_n_epochs=2,
                        max_train_samples=32, feature="avg")
    seen = []
    probe_evaluate = probe.evaluate
    probe.evaluate = lambda t, m: seen.append(t.current_epoch) or probe_evaluate(t, m)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", logger=False, enable_checkpointing=False,
        callbacks=[probe], max_epochs=2, limit_val_batches=1, num_sanity_val_steps=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=data)
    assert seen == [1]  # after the 2nd epoch only; never in the sanity check
    assert "probe/linear_top1" in trainer.callback_metrics


def test_bad_settings_fail_early():
    with pytest.raises(ValueError, match="feature"):
        LinearProbe(feature="mean")
    with pytest.raises(ValueError, match="method"):
        LinearProbe(method="svm")
    with pytest.raises(ValueError, match="k >= 1"):
        KNNProbe(k=0)


def test_probes_and_zero_shot_on_image_folders_log_their_figures_in_fit(tiny_demo, tiny_clip_json, tmp_path):
    """Labelled image folders (no classnames.txt: the folder names) in every evaluation callback,
    during ``fit`` with validation on. Before: each callback's setup died on
    ``ImageFolder.find_classes(data)`` called on the class."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from tests.data.image_helpers import write_image_folder

    folder = str(write_image_folder(tmp_path / "folder", ["cat", "dog", "red_fox"], 4))
    model = CLIP(tiny_clip_json, warmup_steps=1)
    data = ImageTextDataModule(
        train_data=tiny_demo.train, val_data=tiny_demo.val, batch_size=16, num_workers=0,
        train_num_samples=16, image_size=32, tokenizer=model.tokenizer,
    )
    kw = {"train_data": folder, "val_data": folder, "batch_size": 8}
    callbacks = [LinearProbe(**kw), KNNProbe(k=3, **kw), ZeroShot(data=folder, batch_size=8)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", logger=CSVLogger(str(tmp_path), name=""),
        enable_checkpointing=False, callbacks=callbacks, max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=data)
    with open(next(tmp_path.glob("version_*/metrics.csv")), newline="") as f:
        rows = list(csv.DictReader(f))
    for key in ("probe/linear_top1", "probe/knn_top1", "val/zero_shot_top1"):
        values = [float(r[key]) for r in rows if r.get(key)]  # what the logger wrote, not the callback's return
        assert len(values) == 1 and 0.0 <= values[0] <= 1.0, key
