"""Weighted k-NN accuracy on frozen features (DINO's protocol) during training and on validate.

Shares its feature extraction with ``LinearProbe`` when both run with the same data and feature::

    trainer:
      callbacks:
        - class_path: mmssl.callbacks.KNNProbe
          init_args: {k: 20, temperature: 0.07}
"""

from __future__ import annotations

from typing import Literal, Optional

import lightning.pytorch as pl
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from mmssl.evaluation.features import check_feature
from mmssl.evaluation.knn import knn_scores
from mmssl.evaluation.online import (
    ProbeSpec,
    check_labelled_set,
    default_data,
    probe_features,
    should_run,
    will_evaluate,
)


class KNNProbe(pl.Callback):
    """Log ``probe/knn_top1`` (and ``probe/knn_top5``): weighted k-NN of val on train features.

    Args:
        train_data: labelled set forming the memory bank; defaults as in ``LinearProbe``.
        val_data: labelled set to classify; defaults as in ``LinearProbe``.
        feature: ``"cls"``, ``"avg"`` or ``"embedding"`` (see ``LinearProbe``).
        k: neighbours (DINO: 20).
        temperature: vote weight exp(cos / T) (DINO: 0.07).
        every_n_epochs: run after every n-th training epoch (and always on ``validate``).
        batch_size: images per extraction batch.
        num_workers: loader workers.
        max_train_samples: use only the first N training samples in the bank.
    """

    def __init__(
        self,
        train_data: Optional[str] = None,
        val_data: Optional[str] = None,
        feature: Literal["cls", "avg", "embedding"] = "cls",
        k: int = 20,
        temperature: float = 0.07,
        every_n_epochs: int = 1,
        batch_size: int = 256,
        num_workers: int = 0,
        max_train_samples: Optional[int] = None,
    ) -> None:
        check_feature(feature)
        if every_n_epochs < 1:
            raise ValueError(
                f"KNNProbe: init_args.every_n_epochs (its trainer.callbacks entry) must be >= 1, got {every_n_epochs}"
            )
        if k < 1 or temperature <= 0:
            raise ValueError(f"KNNProbe: need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
        self.train_data, self.val_data, self.feature = train_data, val_data, feature
        self.k, self.temperature = k, temperature
        self.every_n_epochs, self.batch_size, self.num_workers = every_n_epochs, batch_size, num_workers
        self.max_train_samples = max_train_samples

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not will_evaluate(trainer, stage):
            return
        train, val = default_data(trainer, self.train_data, self.val_data, "KNNProbe")
        check_labelled_set(train, "KNNProbe", "train_data")  # every rank, at start
        check_labelled_set(val, "KNNProbe", "val_data")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not should_run(trainer, self.every_n_epochs):
            return
        # Reduced over ranks already, the same keys on every rank: sync_dist's mean keeps the values.
        for name, value in self.evaluate(trainer, pl_module).items():
            pl_module.log(f"probe/knn_{name}" if name != "skipped" else "probe/skipped", value, sync_dist=True)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        """Score the model; returns ``{"top1", "top5"}`` reduced over ranks and ``"skipped"`` samples."""
        train, val = default_data(trainer, self.train_data, self.val_data, "KNNProbe")
        spec = ProbeSpec(train, val, self.feature, False, self.batch_size, self.num_workers, self.max_train_samples)
        feats = probe_features(trainer, pl_module, spec)
        device, c = pl_module.device, feats.num_classes
        metrics = {f"top{k}": MulticlassAccuracy(c, top_k=k, average="micro").to(device) for k in (1, 5) if k <= c}
        if len(feats.val):
            scores = knn_scores(
                feats.train.features[0].to(device), feats.train.labels.to(device),
                feats.val.features[0].to(device), c, self.k, self.temperature,
            )
            for metric in metrics.values():
                metric.update(scores, feats.val.labels.to(device))
        return {**{k: m.compute() for k, m in metrics.items()}, "skipped": float(feats.skipped)}
