"""Zero-shot accuracy during validation and on ``mmssl validate`` (CLIP sec. 3.1.2)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from torch import Tensor

from mmssl.data.label_files import read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.online import check_labelled_set, evaluation_set, will_evaluate
from mmssl.evaluation.zero_shot import build_zero_shot_classifier, zero_shot_evaluate

__all__ = ["ZeroShot", "build_zero_shot_classifier"]

# What a command-line user types when zero-shot has no labelled set to score.
FIX = ("Pass --data.val_data LABELLED_SET (webdataset shards with cls beside a classnames.txt, or an "
       "image folder), or, for unlabelled data, train without zero-shot: add "
       "--config configs/demo/no_zero_shot.yaml after configs/demo/clip.yaml")


class ZeroShot(pl.Callback):
    """Log zero-shot top-1/top-5 (``val/zero_shot_top1``, ``val/zero_shot_top5``) each validation.

    The model needs ``encode_image``, ``encode_text``, ``tokenizer``, ``image_size``,
    ``image_mean`` and ``image_std``. Each rank scores its own shards; torchmetrics reduces.

    Args:
        data: labelled set (shards with ``cls`` or an image folder) with ``classnames.txt``;
            defaults to the data module's ``eval_data`` (the demo's labelled held-out split),
            else its ``val_data`` (``--data.val_data LABELLED_SET``), as every evaluation
            callback (:func:`mmssl.evaluation.online.evaluation_set`).
        classnames: class-names file; defaults to ``classnames.txt`` beside the data.
        templates: templates file; defaults to ``zeroshot_classification_templates.txt`` beside
            the data, else CLIP's 80 ImageNet templates.
        batch_size: images per batch.
        num_workers: loader workers.
        every_n_epochs: run on validations of every n-th epoch (and always on ``validate``).
    """

    def __init__(
        self,
        data: Optional[str] = None,
        classnames: Optional[str] = None,
        templates: Optional[str] = None,
        batch_size: int = 256,
        num_workers: int = 0,
        every_n_epochs: int = 1,
    ) -> None:
        if every_n_epochs < 1:
            raise ValueError(
                f"ZeroShot: init_args.every_n_epochs (its trainer.callbacks entry) must be >= 1, got {every_n_epochs}"
            )
        self.data, self.classnames, self.templates = data, classnames, templates
        self.batch_size, self.num_workers = batch_size, num_workers
        self.every_n_epochs = every_n_epochs

    def _data(self, trainer: pl.Trainer) -> tuple[str, str]:
        """The labelled set and the key that set it (for messages)."""
        found = evaluation_set(trainer.datamodule, self.data)
        if found is None:
            raise ValueError(f"ZeroShot needs a labelled set and the data module offers none. {FIX}")
        return found

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every rank checks at start, so a missing set or class list stops all of them at once.
        if not will_evaluate(trainer, stage):
            return
        data, key = self._data(trainer)
        try:
            check_labelled_set(data, "ZeroShot", key, need_classnames=self.classnames is None)
            read_classnames(data, self.classnames)  # an explicit class list is checked here too
            read_templates(data, self.templates)
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"{err}. {FIX}") from err

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == "fit" and (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        for key, value in self.evaluate(trainer, pl_module).items():
            if key != "num_samples":
                # Already reduced over ranks, so identical on every rank (each reaches this call):
                # sync_dist's mean leaves the figure as it is and tells Lightning so.
                pl_module.log(f"val/zero_shot_{key}", value, sync_dist=True)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        """Score the model; returns ``{"top1", "top5", "num_samples", "skipped"}`` reduced over ranks."""
        data, _ = self._data(trainer)
        classnames = read_classnames(data, self.classnames)
        templates = read_templates(data, self.templates)
        transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
        batches = labeled_loader(
            data, transform, self.batch_size, self.num_workers, trainer.global_rank, trainer.world_size
        )
        return zero_shot_evaluate(
            pl_module, batches, classnames, templates, pl_module.device,
            trainer.precision_plugin.forward_context,
        )
