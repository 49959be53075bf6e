"""Dense features: a linear probe on frozen patch tokens, scored by mean IoU.

How much of its pixels' class each patch token carries: what SigLIP 2's local terms (Tschannen et
al. 2025: self-distillation and masked prediction on patches) are meant to improve, and what it
reports as frozen-encoder segmentation. The protocol is DINOv2's "linear" segmentation probe (Oquab
et al. 2023: a linear layer predicts class logits from each frozen patch token), scored here at patch
resolution (each patch's majority class, no upsampling to pixels) on held-out images, by the
segmentation metric, mIoU. Pure functions of tensors: the tool and, later, a callback call them.

The model gives its tokens through ``forward_features(images) -> (B, 1+L, D)``, the class token
first then the L patch tokens in raster order (the probe protocol of
:mod:`mmssl.evaluation.features`; register tokens already dropped): mmssl's MAE, CLIP (SigLIP and
CoCa too) and ImageClassifier, and timm files and folders through
:func:`mmssl.evaluation.encoders.load_encoder`.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmssl.evaluation.features import frozen_eval
from mmssl.evaluation.linear import fit_linear


def patch_labels(masks: Tensor, patch_size: int, num_classes: int) -> Tensor:
    """Each patch's majority class: pixel labels (N, H, W) -> patch labels (N, H/p, W/p).

    A tie between classes goes to the lower class id (a patch half background, half shape is
    background): a fixed rule, so the labels do not depend on the order torch breaks ties in.

    Args:
        masks: (N, H, W) integer class ids in ``[0, num_classes)``.
        patch_size: p, the side of the model's square patches; H and W must be multiples of it.
        num_classes: C.

    Returns:
        (N, H/p, W/p) int64 class ids.

    Raises:
        ValueError: a side that is no multiple of ``patch_size``, or a label outside ``[0, C)``.
    """
    n, h, w = masks.shape
    if patch_size < 1 or h % patch_size or w % patch_size:
        raise ValueError(f"masks of {h} x {w} pixels do not split into patches of {patch_size}")
    masks = masks.long()
    if masks.numel() and (int(masks.min()) < 0 or int(masks.max()) >= num_classes):
        raise ValueError(f"pixel labels must lie in [0, {num_classes}), got [{int(masks.min())}, {int(masks.max())}]")
    gh, gw = h // patch_size, w // patch_size
    patches = masks.reshape(n, gh, patch_size, gw, patch_size).permute(0, 1, 3, 2, 4)  # (N, gh, gw, p, p)
    counts = F.one_hot(patches.reshape(n, gh, gw, -1), num_classes).sum(dim=-2)  # (N, gh, gw, C)
    # count * C - class: the largest count wins, and among equal counts the lowest class (the
    # offset is below C, so it never outweighs one pixel more).
    key = counts * num_classes - torch.arange(num_classes, device=masks.device)
    return key.argmax(dim=-1)


def grid_side(num_patches: int) -> int:
    """The side of a square patch grid of ``num_patches`` tokens.

    Raises:
        ValueError: ``num_patches`` is not a square.
    """
    side = math.isqrt(num_patches)
    if side * side != num_patches or side == 0:
        raise ValueError(f"{num_patches} patch tokens form no square grid (a square image gives g x g patches)")
    return side


def square_side(model: nn.Module) -> int:
    """The side of the square images ``model`` takes (its ``image_size``: an int or a pair).

    Raises:
        ValueError: a model of non-square (or unknown) input size: the demo scenes are square.
    """
    size = getattr(model, "image_size", None)
    sides = (size, size) if isinstance(size, int) else tuple(size or ())
    if len(sides) == 2 and sides[0] == sides[1]:
        try:
            return operator.index(sides[0])
        except TypeError:
            pass
    raise ValueError(f"{type(model).__name__} takes {size!r} images: the demo scenes are square")


def patch_tokens(model: nn.Module, images: Tensor) -> Tensor:
    """Frozen patch tokens of one batch, the class token dropped: (B, 3, H, W) -> (B, g, g, D).

    Args:
        model: with ``forward_features(images) -> (B, 1+L, D)`` (class token first).
        images: (B, 3, H, W) normalised images, H == W.

    Returns:
        (B, g, g, D) float32, the patch at row i, column j of the grid at ``[:, i, j]``.
    """
    tokens = model.forward_features(images)  # (B, 1+L, D)
    patches = tokens[:, 1:]  # (B, L, D): timm and open_clip put the prefix tokens first
    side = grid_side(patches.shape[1])
    return patches.reshape(patches.shape[0], side, side, patches.shape[2]).float()


def extract_patch_tokens(
    model: nn.Module,
    images: Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    batch_size: int = 64,
    device: Optional[torch.device] = None,
) -> Tensor:
    """Frozen patch tokens of a set of uint8 images (:func:`patch_tokens`, in batches, model frozen).

    Args:
        model: with the probe protocol's ``forward_features``.
        images: (N, H, W, 3) uint8 RGB at the model's input size (no resizing here).
        mean, std: the model's normalisation (``image_mean`` / ``image_std``).
        batch_size: images per forward.
        device: where the model runs (its own device by default).

    Returns:
        (N, g, g, D) float32 on the CPU.
    """
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"expected (N, H, W, 3) uint8 images, got {tuple(images.shape)} {images.dtype}")
    if device is None:
        device = next(model.parameters()).device
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    chunks = []
    with frozen_eval(model):
        for i in range(0, images.shape[0], batch_size):
            x = images[i : i + batch_size].to(device).permute(0, 3, 1, 2).float() / 255  # (B, 3, H, W)
            chunks.append(patch_tokens(model, (x - mean_t) / std_t).cpu())
    if not chunks:
        raise ValueError("no images to extract patch tokens from")
    return torch.cat(chunks)


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """Counts of (true class, predicted class) pairs: (M,), (M,) -> (C, C) int64, rows the truth.

    A sum over samples: parts (ranks, batches) add up to the whole set's.
    """
    if pred.shape != target.shape:
        raise ValueError(f"predictions {tuple(pred.shape)} and targets {tuple(target.shape)} differ in shape")
    flat = target.reshape(-1).long() * num_classes + pred.reshape(-1).long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def segmentation_scores(confusion: Tensor, class_names: Optional[list[str]] = None) -> dict:
    """mIoU and accuracy from a confusion matrix (rows the truth, columns the prediction).

    IoU of class c = TP / (TP + FP + FN) over all held-out patches (PASCAL VOC's definition, as
    mmsegmentation computes it over the whole set, not per image); mIoU averages it over the classes
    whose union TP + FP + FN is not empty (a class neither present nor predicted says nothing), the
    background included. Accuracy is the fraction of patches right.

    Args:
        confusion: (C, C) counts.
        class_names: C names for ``per_class_iou`` (default the class ids as text).

    Returns:
        ``miou``, ``patch_accuracy``, ``per_class_iou`` (name -> IoU, ``None`` where the union is
        empty), ``num_patches``.
    """
    confusion = confusion.double()
    tp = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - tp  # TP + FP + FN, (C,)
    total = float(confusion.sum())
    if total == 0:
        raise ValueError("no patches to score")
    names = class_names or [str(c) for c in range(confusion.shape[0])]
    if len(names) != confusion.shape[0]:
        raise ValueError(f"{len(names)} class names for {confusion.shape[0]} classes")
    counted = union > 0
    iou = tp[counted] / union[counted]
    return {
        "miou": float(iou.mean()),
        "patch_accuracy": float(tp.sum()) / total,
        "per_class_iou": {name: (float(tp[c] / union[c]) if counted[c] else None) for c, name in enumerate(names)},
        "num_patches": int(total),
    }


def dense_probe(
    train_tokens: Tensor,
    train_labels: Tensor,
    test_tokens: Tensor,
    test_labels: Tensor,
    num_classes: int,
    class_names: Optional[list[str]] = None,
    weight_decay: float = 1e-4,
    max_iter: int = 300,
) -> dict:
    """Fit a linear classifier on every training patch token and score it on the test patches.

    The classifier is :func:`mmssl.evaluation.linear.fit_logistic` (multinomial logistic regression
    by full-batch L-BFGS on standardised features: one convex optimum, no seed or schedule to tune),
    each patch token one sample, shared by all positions of the grid.

    Args:
        train_tokens: (N, g, g, D) frozen patch tokens.
        train_labels: (N, g, g) patch classes (:func:`patch_labels`).
        test_tokens: (M, g, g, D).
        test_labels: (M, g, g).
        num_classes: C.
        class_names: C names for ``per_class_iou``.
        weight_decay: the L2 penalty of the fit.
        max_iter: L-BFGS iterations.

    Returns:
        :func:`segmentation_scores` of the test patches, with ``num_train_patches`` and
        ``confusion`` (C x C list of counts, rows the truth).
    """
    for tokens, labels, name in ((train_tokens, train_labels, "train"), (test_tokens, test_labels, "test")):
        if tokens.shape[:-1] != labels.shape:
            raise ValueError(f"{name} tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} do not match")
    dim = train_tokens.shape[-1]
    classifier = fit_linear(train_tokens.reshape(-1, dim), train_labels.reshape(-1), num_classes, "lbfgs",
                            weight_decay=weight_decay, max_iter=max_iter)
    with torch.no_grad():
        pred = classifier(test_tokens.reshape(-1, dim).float()).argmax(dim=-1)  # (M * g * g,)
    confusion = confusion_matrix(pred, test_labels.reshape(-1), num_classes)
    return {**segmentation_scores(confusion, class_names), "num_train_patches": int(train_labels.numel()),
            "confusion": confusion.tolist()}
