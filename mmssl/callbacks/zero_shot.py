"""Zero-shot classification during validation (CLIP sec. 3.1.2): prompts -> class embeddings."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from mmssl.data.labeled import labeled_loader, read_classnames, read_templates
from mmssl.data.transforms import eval_transform


@torch.no_grad()
def build_zero_shot_classifier(
    encode_text: Callable[[Tensor], Tensor],
    tokenizer: Callable[[list[str]], Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
) -> Tensor:
    """Average the normalised embeddings of every prompt of a class (CLIP's prompt ensembling).

    Args:
        encode_text: (N, L) tokens -> (N, D) embeddings.
        tokenizer: list of strings -> (N, L) tokens.
        classnames: C class names.
        templates: T prompt templates with a ``{c}`` placeholder.
        device: where the tokens go.

    Returns:
        (D, C) classifier: column c is the renormalised mean prompt embedding of class c.
    """
    weights = []
    for name in classnames:
        tokens = tokenizer([t.format(c=name) for t in templates]).to(device)  # (T, L)
        emb = F.normalize(encode_text(tokens).float(), dim=-1).mean(dim=0)  # (D,)
        weights.append(F.normalize(emb, dim=-1))
    return torch.stack(weights, dim=1)  # (D, C)


class ZeroShot(pl.Callback):
    """Log zero-shot top-1/top-5 (``val/zero_shot_top1``, ``val/zero_shot_top5``) each validation.

    The model needs ``encode_image``, ``encode_text``, ``tokenizer``, ``image_size``,
    ``image_mean`` and ``image_std``. Each rank scores its own shards; torchmetrics reduces.

    Args:
        data: labelled folder (shards with ``cls``, ``classnames.txt``, optional templates);
            defaults to the data module's ``eval_data`` (the demo's held-out split).
        batch_size: images per batch.
        num_workers: loader workers.
        every_n_epochs: run on validations of every n-th epoch.
    """

    def __init__(
        self,
        data: Optional[str] = None,
        batch_size: int = 256,
        num_workers: int = 0,
        every_n_epochs: int = 1,
    ) -> None:
        self.data, self.batch_size, self.num_workers = data, batch_size, num_workers
        self.every_n_epochs = every_n_epochs

    def _folder(self, trainer: pl.Trainer) -> str:
        folder = self.data or getattr(trainer.datamodule, "eval_data", None)
        if not folder:
            raise ValueError("ZeroShot: set init_args.data to a labelled folder (classnames.txt + shards with cls)")
        return folder

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs:
            return
        for key, value in self.evaluate(trainer, pl_module).items():
            pl_module.log(f"val/zero_shot_{key}", value)

    @torch.no_grad()
    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        """Score the model; returns ``{"top1": ..., "top5": ...}`` reduced over ranks."""
        folder = self._folder(trainer)
        classnames, templates = read_classnames(folder), read_templates(folder)
        device = pl_module.device
        transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
        metrics = {
            f"top{k}": MulticlassAccuracy(num_classes=len(classnames), top_k=k, average="micro").to(device)
            for k in (1, 5) if k <= len(classnames)
        }
        with trainer.precision_plugin.forward_context():
            classifier = build_zero_shot_classifier(
                pl_module.encode_text, pl_module.tokenizer, classnames, templates, device
            )
            for batch in labeled_loader(folder, transform, self.batch_size, self.num_workers):
                features = F.normalize(pl_module.encode_image(batch["image"].to(device)).float(), dim=-1)
                logits = features @ classifier  # (B, C)
                for metric in metrics.values():
                    metric.update(logits, batch["label"].to(device))
        return {k: m.compute() for k, m in metrics.items()}
