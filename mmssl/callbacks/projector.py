"""Held-out embeddings, labels and thumbnails in TensorBoard's projector (``add_embedding``)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from mmssl.data.label_files import read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import FeatureSet, frozen_eval, gather_feature_set, image_features
from mmssl.evaluation.online import check_labelled_set, evaluation_set
from mmssl.evaluation.zero_shot import build_zero_shot_classifier


class EmbeddingProjector(pl.Callback):
    """Every ``every_n_validations`` validations, write the held-out set's embeddings to TensorBoard.

    Tag ``image``: each image's embedding (``encode_image``: CLIP's projected embedding, MAE's
    cls token) with its class name and a thumbnail. For a CLIP (a model with ``encode_text`` and
    ``tokenizer``) also tag ``image_text``: the same points plus one text point per class (its
    prompt-ensemble embedding, as zero-shot uses), in one space, with columns ``kind`` and ``class``.
    Open TensorBoard's PROJECTOR tab to look at the clusters (PCA, t-SNE, UMAP).

    Every rank embeds its share of the set; the rows are gathered in the order one process reads
    them (so 1 and N processes write the same file) and rank 0 writes them.

    Args:
        data: labelled set (shards with ``cls`` or an image folder); defaults to the data
            module's ``eval_data``, else its ``val_data``
            (:func:`mmssl.evaluation.online.evaluation_set`).
        classnames: class-names file; defaults to ``classnames.txt`` beside the data, else the
            labels are written as numbers.
        templates: prompt templates of the text points; defaults as for zero-shot.
        every_n_validations: write at every n-th validation of ``fit`` (and on ``validate``).
        max_samples: the set's first N samples (TensorBoard's sprite holds 8192 / thumbnail_size
            squared thumbnails at most).
        thumbnail_size: side of the thumbnails in pixels.
        batch_size: images per batch.
        num_workers: loader workers.
    """

    def __init__(
        self,
        data: Optional[str] = None,
        classnames: Optional[str] = None,
        templates: Optional[str] = None,
        every_n_validations: int = 1,
        max_samples: int = 2000,
        thumbnail_size: int = 32,
        batch_size: int = 256,
        num_workers: int = 0,
    ) -> None:
        if every_n_validations < 1:
            raise ValueError(f"EmbeddingProjector: every_n_validations must be >= 1, got {every_n_validations}")
        if max_samples < 1 or max_samples > (8192 // thumbnail_size) ** 2:
            raise ValueError(f"EmbeddingProjector: max_samples must be in [1, {(8192 // thumbnail_size) ** 2}] "
                             f"(TensorBoard's 8192-pixel sprite at thumbnail_size {thumbnail_size}), got {max_samples}")
        self.data, self.classnames, self.templates = data, classnames, templates
        self.every_n_validations, self.max_samples = every_n_validations, max_samples
        self.thumbnail_size, self.batch_size, self.num_workers = thumbnail_size, batch_size, num_workers
        self._validations = 0

    def _data(self, trainer: pl.Trainer) -> str:
        found = evaluation_set(trainer.datamodule, self.data)
        if found is None:
            raise ValueError("EmbeddingProjector needs a labelled set and the data module offers none: pass "
                             "--data.val_data LABELLED_SET (shards with cls, or an image folder), or set "
                             "init_args.data in its trainer.callbacks entry")
        return found[0]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.limit_val_batches == 0:
            return  # no validation, never called
        if not any(isinstance(logger, TensorBoardLogger) for logger in trainer.loggers):
            raise ValueError("EmbeddingProjector writes to TensorBoard's projector: the trainer has no "
                             "TensorBoardLogger; drop --trainer.logger (mmssl's default logs to TensorBoard) or "
                             "add --trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger")
        check_labelled_set(self._data(trainer), "EmbeddingProjector", "data")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if trainer.state.fn == "fit" and self._validations % self.every_n_validations:
            return
        points = self.embed(trainer, pl_module)  # every rank: it gathers
        text = self._class_embeddings(trainer, pl_module, points)  # every rank: a forward may be a collective
        if trainer.is_global_zero and len(points):
            self._write(trainer, points, text)

    def embed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FeatureSet:
        """All ranks' embeddings and thumbnails, in one process's reading order.

        Returns:
            ``features == [embeddings (N, D), thumbnails (N, 3 * s * s)]`` with labels, the same
            on every rank.
        """
        data = self._data(trainer)
        transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
        batches = labeled_loader(data, transform, self.batch_size, self.num_workers, trainer.global_rank,
                                 trainer.world_size, limit=self.max_samples)
        mean = torch.tensor(pl_module.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(pl_module.image_std).view(1, 3, 1, 1)
        chunks: list[tuple[Tensor, Tensor]] = []
        labels, index, skipped = [], [], 0
        with frozen_eval(pl_module):
            for batch in batches:
                skipped += int(batch.get("skipped", 0))
                if len(batch["label"]) == 0:
                    continue
                with trainer.precision_plugin.forward_context():
                    embedding = image_features(pl_module, batch["image"].to(pl_module.device), "embedding")[0]
                size = (self.thumbnail_size, self.thumbnail_size)
                thumbs = F.interpolate((batch["image"] * std + mean).clamp(0, 1), size=size, mode="bilinear",
                                       antialias=True, align_corners=False)  # (B, 3, s, s)
                chunks.append((embedding.float().cpu(), thumbs.flatten(1)))
                labels.append(batch["label"].long())
                index.append(batch["index"].long())
        if chunks:
            local = FeatureSet([torch.cat(c) for c in zip(*chunks)], torch.cat(labels), torch.cat(index), skipped)
        else:  # a rank with no share still joins every gather below
            local = FeatureSet([], torch.zeros(0, dtype=torch.long), skipped=skipped)
        return gather_feature_set(local, lambda t: pl_module.all_gather(t.to(pl_module.device)), trainer.world_size)

    def _names(self, trainer: pl.Trainer, labels: Tensor) -> list[str]:
        try:
            names = read_classnames(self._data(trainer), self.classnames)
        except FileNotFoundError:
            return [str(int(label)) for label in labels]
        return [names[int(label)] if 0 <= int(label) < len(names) else str(int(label)) for label in labels]

    def _class_embeddings(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, points: FeatureSet
    ) -> Optional[tuple[Tensor, list[str]]]:
        """(C, D) prompt-ensemble text embeddings and the class names, for a CLIP; else ``None``."""
        if not (hasattr(pl_module, "encode_text") and getattr(pl_module, "tokenizer", None) is not None):
            return None
        data = self._data(trainer)
        try:
            classnames = read_classnames(data, self.classnames)
        except FileNotFoundError:
            return None
        templates = read_templates(data, self.templates)
        with frozen_eval(pl_module), trainer.precision_plugin.forward_context():
            classifier = build_zero_shot_classifier(pl_module.encode_text, pl_module.tokenizer, classnames,
                                                    templates, pl_module.device, self.batch_size)
        return classifier.T.float().cpu(), classnames

    def _write(self, trainer: pl.Trainer, points: FeatureSet, text: Optional[tuple[Tensor, list[str]]]) -> None:
        """Rank 0 only, no collective: add_embedding to every TensorBoard logger."""
        embeddings, thumbs = points.features
        s = self.thumbnail_size
        thumbs = thumbs.reshape(-1, 3, s, s)
        names = self._names(trainer, points.labels)
        step = trainer.global_step
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                continue
            writer = logger.experiment
            writer.add_embedding(embeddings, metadata=names, label_img=thumbs, global_step=step, tag="image")
            if text is not None:
                text_embeddings, classnames = text
                image = F.normalize(embeddings, dim=-1)  # CLIP scores cosines: both kinds on the sphere
                joint = torch.cat([image, F.normalize(text_embeddings, dim=-1)])
                metadata = [["image", n] for n in names] + [["text", n] for n in classnames]
                blank = torch.ones(len(classnames), 3, s, s)  # text points: white tiles
                writer.add_embedding(joint, metadata=metadata, label_img=torch.cat([thumbs, blank]),
                                     global_step=step, tag="image_text", metadata_header=["kind", "class"])
            writer.flush()
