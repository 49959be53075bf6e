"""Zero-shot classification (CLIP sec. 3.1.2): prompt ensembles -> a text classifier -> accuracy.

Pure functions over a CLIP-like module (``encode_image``, ``encode_text``, ``tokenizer``), used by
the ``ZeroShot`` callback and ``tools/zero_shot.py``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from open_clip.zero_shot_classifier import build_zero_shot_classifier as open_clip_zero_shot_classifier
from torch import Tensor, nn
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy

from mmssl.evaluation.features import frozen_eval


class _TextTower:
    """What open_clip's classifier builder calls: ``encode_text(tokens, normalize=True)``, in fp32
    (the mean over prompts is taken in full precision, whatever the run's autocast)."""

    def __init__(self, encode_text: Callable[[Tensor], Tensor]) -> None:
        self._encode_text = encode_text

    def encode_text(self, tokens: Tensor, normalize: bool = False) -> Tensor:
        features = self._encode_text(tokens).float()  # (N, D)
        return F.normalize(features, dim=-1) if normalize else features


@torch.no_grad()
def build_zero_shot_classifier(
    encode_text: Callable[[Tensor], Tensor],
    tokenizer: Callable[[list[str]], Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
    batch_size: int = 256,
) -> Tensor:
    """Average the normalised embeddings of every prompt of a class (CLIP's prompt ensembling),
    through open_clip's own ``build_zero_shot_classifier``.

    Args:
        encode_text: (N, L) tokens -> (N, D) embeddings.
        tokenizer: list of strings -> (N, L) tokens.
        classnames: C class names.
        templates: T prompt templates with a ``{c}`` placeholder (CLIP_benchmark's spelling;
            open_clip's builder takes callables for them).
        device: where the tokens go.
        batch_size: about how many prompts go through the text tower at once (whole classes:
            open_clip batches by class).

    Returns:
        (D, C) classifier: column c is the renormalised mean prompt embedding of class c.
    """
    prompts = [lambda c, t=t: t.format(c=c) for t in templates]
    return open_clip_zero_shot_classifier(
        _TextTower(encode_text), tokenizer, list(classnames), prompts,
        num_classes_per_batch=max(1, batch_size // len(templates)), device=device,
    )


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
        ``{"top1": ..., "top5": ...}``, ``"num_samples"`` and ``"skipped"`` (all ranks).
    """
    metrics = zero_shot_metrics(len(classnames), device)
    count = SumMetric().to(device)  # samples seen, summed over ranks like the accuracies
    skipped = SumMetric().to(device)  # unreadable samples left out, likewise
    # Labels outside the class list are counted, not fed to the metrics (which would raise on
    # this rank alone and leave the others waiting in the reduction); every rank raises below.
    bad_labels = SumMetric().to(device)
    with frozen_eval(model), context():
        classifier = build_zero_shot_classifier(model.encode_text, model.tokenizer, classnames, templates, device)
        for batch in batches:
            skipped.update(torch.tensor(float(batch.get("skipped", 0)), device=device))
            if len(batch["label"]) == 0:  # a batch that only reports skipped samples
                continue
            features = F.normalize(model.encode_image(batch["image"].to(device)).float(), dim=-1)
            logits = features @ classifier  # (B, C)
            labels = batch["label"].to(device)
            bad = ((labels < 0) | (labels >= len(classnames))).sum()
            bad_labels.update(bad.float())
            if int(bad):
                continue
            for metric in metrics.values():
                metric.update(logits, labels)
            count.update(torch.tensor(float(batch["label"].shape[0]), device=device))
    if int(bad_labels.compute()):
        raise ValueError(f"zero-shot: {int(bad_labels.compute())} labels outside [0, {len(classnames)}) "
                         f"({len(classnames)} class names); check the set's cls values and classnames.txt")
    return {**{k: m.compute() for k, m in metrics.items()}, "num_samples": count.compute(),
            "skipped": skipped.compute()}
