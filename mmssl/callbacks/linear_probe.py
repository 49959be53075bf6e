"""Linear probe on frozen features during training and on ``mmssl validate``, per layer if asked.

Composed onto any model with the probe protocol (``mmssl.evaluation.features``), from YAML::

    trainer:
      callbacks:
        - class_path: mmssl.callbacks.LinearProbe
          init_args: {feature: cls, method: lbfgs, layers: true, every_n_epochs: 5}
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from mmssl.evaluation.features import check_feature
from mmssl.evaluation.linear import METHODS, score_linear
from mmssl.evaluation.online import (
    ProbeSpec,
    check_labelled_set,
    default_data,
    probe_features,
    run_folder,
    should_run,
    will_evaluate,
)
from mmssl.evaluation.plot import plot_layer_accuracy


class LinearProbe(pl.Callback):
    """Fit a linear classifier on frozen features; log ``probe/linear_top1`` and ``_top5``.

    Runs at the end of validation: after every ``every_n_epochs``-th epoch in ``fit``, and on
    ``validate``. Features are extracted by every rank from its part of the sets, the training
    features gathered so every rank fits the same probe, and the val accuracy reduced across ranks.
    The model's train/eval modes, ``requires_grad`` flags and RNG states are restored afterwards.

    Args:
        train_data: labelled training set (shards with ``cls`` or image folder); defaults to the
            data module's training shards (the demo's carry labels).
        val_data: labelled evaluation set; defaults to the data module's ``eval_data``, else its
            ``val_data`` (:func:`mmssl.evaluation.online.evaluation_set`).
        feature: ``"cls"`` token or ``"avg"`` of the patch tokens (final norm), or the model's
            ``"embedding"`` (``encode_image``: CLIP's projected embedding).
        method: ``"lbfgs"``: exact multinomial logistic regression on standardised features (fast;
            seconds); ``"mae"``: the MAE paper's BatchNorm + LARS recipe.
        layers: also probe every block's output, from the same forward pass, and log
            ``probe/linear_top1_block{i}`` plus a PNG of accuracy against depth.
        every_n_epochs: run after every n-th training epoch.
        batch_size: images per extraction batch.
        num_workers: loader workers for extraction.
        max_train_samples: use only the first N training samples (keeps the probe cheap on
            large training sets).
        weight_decay: L2 penalty of the ``lbfgs`` fit.
        mae_epochs: epochs of the ``mae`` fit (paper 90).
        mae_blr: base learning rate of the ``mae`` fit (paper 0.1).
        mae_optimizer: ``"lars"`` (paper) or ``"sgd"``.
    """

    def __init__(
        self,
        train_data: Optional[str] = None,
        val_data: Optional[str] = None,
        feature: Literal["cls", "avg", "embedding"] = "cls",
        method: Literal["lbfgs", "mae"] = "lbfgs",
        layers: bool = False,
        every_n_epochs: int = 1,
        batch_size: int = 256,
        num_workers: int = 0,
        max_train_samples: Optional[int] = None,
        weight_decay: float = 1e-4,
        mae_epochs: int = 90,
        mae_blr: float = 0.1,
        mae_optimizer: Literal["lars", "sgd"] = "lars",
    ) -> None:
        check_feature(feature)
        if method not in METHODS:
            raise ValueError(f"LinearProbe: method must be one of {METHODS}, got {method!r}")
        if every_n_epochs < 1:
            raise ValueError("LinearProbe: init_args.every_n_epochs (its trainer.callbacks entry) must be >= 1, "
                             f"got {every_n_epochs}")
        self.train_data, self.val_data = train_data, val_data
        self.feature, self.method, self.layers = feature, method, layers
        self.every_n_epochs, self.batch_size, self.num_workers = every_n_epochs, batch_size, num_workers
        self.max_train_samples = max_train_samples
        if method == "lbfgs":
            self.fit_kwargs: dict = {"weight_decay": weight_decay}
        else:
            self.fit_kwargs = {"epochs": mae_epochs, "blr": mae_blr, "optimizer": mae_optimizer}

    def spec(self, trainer: pl.Trainer) -> ProbeSpec:
        """The extraction settings, with data defaults resolved from the trainer's data module."""
        train, val = default_data(trainer, self.train_data, self.val_data, "LinearProbe")
        return ProbeSpec(train, val, self.feature, self.layers, self.batch_size, self.num_workers,
                         self.max_train_samples)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not will_evaluate(trainer, stage):
            return
        spec = self.spec(trainer)  # every rank checks at start, so a bad set stops all of them
        check_labelled_set(spec.train_data, "LinearProbe", "train_data")
        check_labelled_set(spec.val_data, "LinearProbe", "val_data")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not should_run(trainer, self.every_n_epochs):
            return
        results = self.evaluate(trainer, pl_module)
        # Figures of the whole set, identical on every rank, and every rank logs the same keys:
        # sync_dist's mean over ranks leaves them as they are and tells Lightning they are global.
        for name, value in results["final"].items():
            pl_module.log(f"probe/linear_{name}", value, sync_dist=True)
        pl_module.log("probe/skipped", float(results["skipped"]), sync_dist=True)
        per_block = results.get("blocks", [])
        for i, block in enumerate(per_block, start=1):
            pl_module.log(f"probe/linear_top1_block{i}", block["top1"], sync_dist=True)
        if per_block and trainer.is_global_zero:
            self._plot(trainer, [float(b["top1"]) for b in per_block])

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        """Probe the model; returns ``{"final": {"top1", "top5"}, "blocks": [{"top1", ...}], "skipped"}``."""
        feats = probe_features(trainer, pl_module, self.spec(trainer))
        device = pl_module.device
        args = (feats.num_classes, self.method, device)
        out: dict = {"final": score_linear(feats.train, feats.val, 0, *args, **self.fit_kwargs),
                     "skipped": feats.skipped}
        if self.layers:
            out["blocks"] = [
                score_linear(feats.train, feats.val, i, *args, **self.fit_kwargs)
                for i in range(1, len(feats.train.features))
            ]
        return out

    def _plot(self, trainer: pl.Trainer, top1: list[float]) -> None:
        folder = os.path.join(run_folder(trainer), "probe")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"layers_epoch{trainer.current_epoch:03d}_step{trainer.global_step:07d}.png")
        image = plot_layer_accuracy(
            {"linear top-1": top1}, f"{self.method} probe ({self.feature}) per block, step {trainer.global_step}", path
        )
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(
                    "probe/linear_top1_per_block", image, trainer.global_step, dataformats="HWC"
                )
