"""Dense-feature probe during training and on ``mmssl validate``: mIoU of a linear probe on patch tokens.

The online twin of ``mmssl dense-probe`` (``tools/dense_probe.py``), same protocol and figures
(:mod:`mmssl.evaluation.dense`): demo scenes drawn in memory at the model's input size with every
pixel's class (background and the six shapes), each patch labelled with its majority class, a
multinomial logistic regression fitted on the frozen patch tokens of ``train_images`` scenes and
scored on ``test_images`` held-out ones::

    trainer:
      callbacks:
        - class_path: mmssl.callbacks.DenseProbe
          init_args: {train_images: 128, test_images: 64, every_n_epochs: 5}

Logs ``probe/dense_miou`` and ``probe/dense_patch_accuracy``. For any model with the probe
protocol's ``forward_features`` (MAE, CLIP / SigLIP / CoCa, ImageClassifier): what SigLIP 2's local
terms are for. No file is read: the scenes come from the demo renderer, so the probe runs on any
data (the model must take square images of a side its patches tile).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from mmssl.data.demo import DENSE_CLASSES, dense_demo_set
from mmssl.evaluation.dense import (
    confusion_matrix,
    extract_patch_tokens,
    patch_labels,
    segmentation_scores,
    square_side,
)
from mmssl.evaluation.linear import fit_linear
from mmssl.evaluation.online import should_run, will_evaluate


def _side(pl_module: pl.LightningModule) -> int:
    """The model's square input side, or a one-line error naming the callback and the model."""
    try:
        return square_side(pl_module)
    except ValueError as err:
        raise ValueError(f"DenseProbe: {err}") from None


class DenseProbe(pl.Callback):
    """Fit a linear probe on frozen patch tokens of demo scenes; log ``probe/dense_miou``.

    Runs at the end of validation: after every ``every_n_epochs``-th epoch in ``fit`` (never in the
    sanity check), and on ``validate``. Every rank takes every ``world``-th scene (padded to the same
    count, so every rank makes the same forwards: FSDP2 gathers weights in each), the training
    tokens are gathered in scene order so every rank fits the same probe as one process would, and
    the held-out confusion counts are summed over ranks. Modes, ``requires_grad`` and RNG states
    are restored afterwards (:func:`mmssl.evaluation.features.frozen_eval`).

    Args:
        train_images: scenes the probe is fitted on (seed ``seed``).
        test_images: held-out scenes it is scored on (seed ``seed + 1``).
        seed: seed of the training scenes.
        every_n_epochs: run after every n-th training epoch.
        batch_size: images per forward.
        weight_decay: L2 penalty of the logistic regression.
        max_iter: L-BFGS iterations.
    """

    def __init__(
        self,
        train_images: int = 128,
        test_images: int = 64,
        seed: int = 0,
        every_n_epochs: int = 1,
        batch_size: int = 64,
        weight_decay: float = 1e-4,
        max_iter: int = 300,
    ) -> None:
        for key, value in (("train_images", train_images), ("test_images", test_images),
                           ("every_n_epochs", every_n_epochs), ("batch_size", batch_size), ("max_iter", max_iter)):
            if value < 1:
                raise ValueError(f"DenseProbe: init_args.{key} (its trainer.callbacks entry) must be >= 1, got {value}")
        if weight_decay < 0:
            raise ValueError(f"DenseProbe: init_args.weight_decay must be >= 0, got {weight_decay}")
        self.train_images, self.test_images, self.seed = train_images, test_images, seed
        self.every_n_epochs, self.batch_size = every_n_epochs, batch_size
        self.weight_decay, self.max_iter = weight_decay, max_iter
        self._scenes: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not will_evaluate(trainer, stage):
            return
        # Every rank checks at start: a model without patch tokens stops the run before training.
        if not callable(getattr(pl_module, "forward_features", None)):
            raise ValueError(f"DenseProbe: {type(pl_module).__name__} gives no patch tokens (no forward_features): "
                             "the dense probe needs a ViT image tower")
        _side(pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not should_run(trainer, self.every_n_epochs):
            return
        scores = self.evaluate(trainer, pl_module)
        # The same figures on every rank (summed counts): sync_dist's mean keeps them and marks them global.
        pl_module.log("probe/dense_miou", scores["miou"], sync_dist=True)
        pl_module.log("probe/dense_patch_accuracy", scores["patch_accuracy"], sync_dist=True)

    def scenes(self, count: int, side: int, seed: int) -> tuple[Tensor, Tensor]:
        """``count`` scenes of ``side`` pixels and their pixel classes, drawn once per run."""
        key = (count, side, seed)
        if key not in self._scenes:
            images, masks = dense_demo_set(count, side, seed)
            self._scenes[key] = (torch.from_numpy(images), torch.from_numpy(masks))
        return self._scenes[key]

    def _tokens(self, trainer: pl.Trainer, pl_module: pl.LightningModule, images: Tensor) -> Tensor:
        """This rank's share of ``images`` (every ``world``-th from ``rank``, padded with its last
        one to ``ceil(N / world)``) through the frozen model: (ceil(N / world), g, g, D)."""
        world, rank = trainer.world_size, trainer.global_rank
        per_rank = math.ceil(images.shape[0] / world)
        index = list(range(rank, images.shape[0], world))
        index += [index[-1] if index else 0] * (per_rank - len(index))
        with trainer.precision_plugin.forward_context():
            return extract_patch_tokens(pl_module, images[index], pl_module.image_mean, pl_module.image_std,
                                        self.batch_size, pl_module.device)

    def _gather(self, pl_module: pl.LightningModule, local: Tensor, world: int) -> Tensor:
        """Every rank's share back in scene order: rank r's j-th token set is scene ``j * world + r``."""
        if world == 1:
            return local
        gathered = pl_module.all_gather(local.to(pl_module.device)).cpu()  # (world, per_rank, ...)
        return gathered.transpose(0, 1).reshape(-1, *local.shape[1:])

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The probe's figures on the held-out scenes, the same on every rank.

        Returns:
            :func:`mmssl.evaluation.dense.segmentation_scores` (``miou``, ``patch_accuracy``,
            ``per_class_iou``, ``num_patches``).
        """
        side, world, rank = _side(pl_module), trainer.world_size, trainer.global_rank
        train_images, train_masks = self.scenes(self.train_images, side, self.seed)
        test_images, test_masks = self.scenes(self.test_images, side, self.seed + 1)
        train_tokens = self._gather(pl_module, self._tokens(trainer, pl_module, train_images), world)
        train_tokens = train_tokens[: self.train_images]  # (N, g, g, D), the padding dropped
        test_tokens = self._tokens(trainer, pl_module, test_images)  # this rank's share, padded
        grid = train_tokens.shape[1]
        if side % grid:
            raise ValueError(f"DenseProbe: {type(pl_module).__name__}'s {grid} x {grid} patch grid does not tile "
                             f"its {side}-pixel images")
        classes = len(DENSE_CLASSES)
        train_labels = patch_labels(train_masks, side // grid, classes)
        own = list(range(rank, self.test_images, world))  # the held-out scenes this rank scores
        test_labels = patch_labels(test_masks[own], side // grid, classes)
        dim = train_tokens.shape[-1]
        probe = fit_linear(train_tokens.reshape(-1, dim), train_labels.reshape(-1), classes, "lbfgs",
                           weight_decay=self.weight_decay, max_iter=self.max_iter)
        with torch.no_grad():
            pred = probe(test_tokens[: len(own)].reshape(-1, dim).float()).argmax(dim=-1)
        confusion = confusion_matrix(pred, test_labels.reshape(-1), classes)
        if world > 1:  # a rank with no held-out scene still joins, with zero counts
            confusion = pl_module.all_gather(confusion.to(pl_module.device)).cpu().sum(dim=0)
        return segmentation_scores(confusion, list(DENSE_CLASSES))

