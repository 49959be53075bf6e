"""How often a CoCa's captions name the image's class, during validation (``val/caption_names_class``)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl

from mmssl.callbacks.zero_shot import FIX
from mmssl.data.label_files import read_classnames
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.captions import caption_naming_evaluate
from mmssl.evaluation.online import check_labelled_set, evaluation_set, will_evaluate
from mmssl.models.generation import GENERATION_TYPES


class CaptionNaming(pl.Callback):
    """Log ``val/caption_names_class``: the share of a labelled set's images whose generated
    caption names their class (``mmssl.evaluation.captions.names_class``) at each validation.

    Each rank captions its own shards; the counts are summed over ranks (a rank with none still
    takes part). Generation draws from a forked RNG, so training's random stream is untouched.

    Args:
        data: labelled set with ``classnames.txt``; defaults to the data module's ``eval_data``,
            else its ``val_data`` (:func:`mmssl.evaluation.online.evaluation_set`).
        classnames: class-names file; defaults to ``classnames.txt`` beside the data.
        max_samples: caption only the set's first this many samples (the same ones on any number
            of ranks); ``None`` for all.
        generation_type: ``top_k`` (default, with ``top_k=1``: greedy), ``top_p`` or ``beam_search``.
        seq_len: longest caption in tokens, start and end included.
        top_k: ``top_k`` sampling's k.
        batch_size: images per batch (each generation step holds (B, t, vocabulary) logits).
        num_workers: loader workers.
    """

    def __init__(self, data: Optional[str] = None, classnames: Optional[str] = None, max_samples: Optional[int] = 256,
                 generation_type: str = "top_k", seq_len: int = 12, top_k: int = 1, batch_size: int = 32,
                 num_workers: int = 0) -> None:
        if generation_type not in GENERATION_TYPES:
            raise ValueError(
                f"CaptionNaming: generation_type {generation_type!r} is not one of {list(GENERATION_TYPES)}"
            )
        self.data, self.classnames, self.max_samples = data, classnames, max_samples
        self.generation = {"generation_type": generation_type, "seq_len": seq_len}
        if generation_type == "top_k":
            self.generation["top_k"] = top_k
        self.batch_size, self.num_workers = batch_size, num_workers

    def _data(self, trainer: pl.Trainer) -> str:
        found = evaluation_set(trainer.datamodule, self.data)
        if found is None:
            raise ValueError(f"CaptionNaming needs a labelled set and the data module offers none. {FIX}")
        return found[0]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not will_evaluate(trainer, stage):
            return
        if not hasattr(pl_module, "generation_ids"):
            raise TypeError(
                f"CaptionNaming needs a captioning model (mmssl.models.coca.CoCa), not {type(pl_module).__name__}"
            )
        data = self._data(trainer)
        check_labelled_set(data, "CaptionNaming", "init_args.data", need_classnames=self.classnames is None)
        read_classnames(data, self.classnames)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        data = self._data(trainer)
        transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
        batches = labeled_loader(data, transform, self.batch_size, self.num_workers, trainer.global_rank,
                                 trainer.world_size, limit=self.max_samples)
        out = caption_naming_evaluate(pl_module, batches, read_classnames(data, self.classnames), pl_module.device,
                                      trainer.precision_plugin.forward_context, **self.generation)
        pl_module.log("val/caption_names_class", out["names_class"], sync_dist=True)  # already reduced
