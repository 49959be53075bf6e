"""Zero-shot classification during validation (CLIP sec. 3.1.2): prompts -> class embeddings."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy

from mmssl.data.labeled import labeled_loader, read_classnames, read_templates
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import frozen_eval


@torch.no_grad()
def build_zero_shot_classifier(
    encode_text: Callable[[Tensor], Tensor],
    tokenizer: Callable[[list[str]], Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
    batch_size: int = 256,
) -> Tensor:
    """Average the normalised embeddings of every prompt of a class (CLIP's prompt ensembling).

    All C x T prompts are encoded in batches of ``batch_size`` (open_clip's
    ``build_zero_shot_classifier`` batches the same way), not one class at a time.

    Args:
        encode_text: (N, L) tokens -> (N, D) embeddings.
        tokenizer: list of strings -> (N, L) tokens.
        classnames: C class names.
        templates: T prompt templates with a ``{c}`` placeholder.
        device: where the tokens go.
        batch_size: prompts per text-tower batch.

    Returns:
        (D, C) classifier: column c is the renormalised mean prompt embedding of class c.
    """
    prompts = [t.format(c=name) for name in classnames for t in templates]  # class-major, C*T
    embeddings = []
    for start in range(0, len(prompts), batch_size):
        tokens = tokenizer(prompts[start : start + batch_size]).to(device)  # (b, L)
        embeddings.append(F.normalize(encode_text(tokens).float(), dim=-1))
    emb = torch.cat(embeddings).reshape(len(classnames), len(templates), -1)  # (C, T, D)
    return F.normalize(emb.mean(dim=1), dim=-1).T  # (D, C)


def zero_shot_metrics(num_classes: int, device: torch.device) -> dict[str, MulticlassAccuracy]:
    """Top-1 and top-5 (when C >= 5) accuracy metrics, which reduce across ranks on compute."""
    return {
        f"top{k}": MulticlassAccuracy(num_classes=num_classes, top_k=k, average="micro").to(device)
        for k in (1, 5) if k <= num_classes
    }


@torch.no_grad()
def zero_shot_evaluate(
    model: nn.Module,
    batches,
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, Tensor]:
    """Zero-shot top-1/top-5 of ``model`` (``encode_image``, ``encode_text``, ``tokenizer``).

    The text classifier is built once, then every batch is scored against it; the torchmetrics
    accuracies reduce over ranks when a process group is up, so every rank returns the total.

    Args:
        model: the CLIP-like module (left in its original state afterwards).
        batches: this rank's ``{"image", "label"}`` batches.
        classnames: C class names in label order.
        templates: prompt templates with ``{c}``.
        device: the model's device.
        context: precision context entered around forwards.

    Returns:
        ``{"top1": ..., "top5": ...}`` and ``"num_samples"`` (all ranks).
    """
    metrics = zero_shot_metrics(len(classnames), device)
    count = SumMetric().to(device)  # samples seen, summed over ranks like the accuracies
    with frozen_eval(model), context():
        classifier = build_zero_shot_classifier(model.encode_text, model.tokenizer, classnames, templates, device)
        for batch in batches:
            features = F.normalize(model.encode_image(batch["image"].to(device)).float(), dim=-1)
            logits = features @ classifier  # (B, C)
            for metric in metrics.values():
                metric.update(logits, batch["label"].to(device))
            count.update(torch.tensor(float(batch["label"].shape[0]), device=device))
    return {**{k: m.compute() for k, m in metrics.items()}, "num_samples": count.compute()}


class ZeroShot(pl.Callback):
    """Log zero-shot top-1/top-5 (``val/zero_shot_top1``, ``val/zero_shot_top5``) each validation.

    The model needs ``encode_image``, ``encode_text``, ``tokenizer``, ``image_size``,
    ``image_mean`` and ``image_std``. Each rank scores its own shards; torchmetrics reduces.

    Args:
        data: labelled set (shards with ``cls`` or an image folder) with ``classnames.txt``;
            defaults to the data module's ``eval_data`` (the demo's held-out split).
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
            raise ValueError(f"ZeroShot: every_n_epochs must be >= 1, got {every_n_epochs}")
        self.data, self.classnames, self.templates = data, classnames, templates
        self.batch_size, self.num_workers = batch_size, num_workers
        self.every_n_epochs = every_n_epochs

    def _data(self, trainer: pl.Trainer) -> str:
        data = self.data or getattr(trainer.datamodule, "eval_data", None)
        if not data:
            raise ValueError("ZeroShot: set init_args.data to a labelled set (classnames.txt + shards with cls)")
        return data

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == "fit" and (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        for key, value in self.evaluate(trainer, pl_module).items():
            if key != "num_samples":
                pl_module.log(f"val/zero_shot_{key}", value)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        """Score the model; returns ``{"top1", "top5", "num_samples"}`` reduced over ranks."""
        data = self._data(trainer)
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
