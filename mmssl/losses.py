"""Losses as pure functions of tensors: no stored rank, world size or module state."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, Fig. 3), pair i matching pair i.

    With the gathered features of all ranks this is open_clip's ``ClipLoss(local_loss=True,
    gather_with_grad=True)``: this rank's B rows against all N columns, the positives at
    ``offset + i``. The mean over ranks of these local losses is the loss of one process on the
    concatenated batch, so DDP's gradient averaging yields the global gradient. Written here
    rather than wrapping ``open_clip.loss.ClipLoss`` because that module stores rank and world
    size and gathers inside; mmssl gathers once, in ``mmssl.distributed`` (tests check the two
    agree).

    Args:
        image_features: (B, D) L2-normalised image embeddings of this rank.
        text_features: (B, D) L2-normalised text embeddings, row i paired with image i.
        logit_scale: scalar, the temperature's inverse (already exponentiated).
        all_image_features: (N, D) image embeddings of every rank; ``None``: this rank's only.
        all_text_features: (N, D) text embeddings of every rank; ``None``: this rank's only.
        offset: index of this rank's first row among the N (``rank * B`` with equal batches).

    Returns:
        Scalar: mean of the image->text and text->image cross-entropies over this rank's rows.
    """
    all_image = image_features if all_image_features is None else all_image_features
    all_text = text_features if all_text_features is None else all_text_features
    logits_per_image = logit_scale * image_features @ all_text.T  # (B, N)
    logits_per_text = logit_scale * text_features @ all_image.T  # (B, N)
    labels = torch.arange(image_features.shape[0], device=image_features.device) + offset  # (B,)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Sigmoid loss of SigLIP (Zhai et al. 2023, Algorithm 1): every pair a binary decision.

    ``-sum_ij log sigmoid(z_ij (t x_i.y_j + b)) / B`` with z = +1 for the matching pair, -1
    otherwise, summed over this rank's B images and the texts of all ranks: what open_clip's
    ``SigLipLoss`` computes with its neighbour exchange, here from one all-gather of the texts
    (``mmssl.distributed.gather_with_grad``). Dividing by the local B makes the mean over ranks
    equal the single-process loss on the concatenated batch, as for :func:`clip_loss`.

    Args:
        image_features: (B, D) L2-normalised image embeddings of this rank.
        text_features: (B, D) L2-normalised text embeddings, row i paired with image i.
        logit_scale: scalar t (already exponentiated; SigLIP initialises it to 10).
        logit_bias: scalar b (SigLIP initialises it to -10).
        all_text_features: (N, D) text embeddings of every rank; ``None``: this rank's only.
        offset: index of this rank's first row among the N.

    Returns:
        Scalar loss.
    """
    all_text = text_features if all_text_features is None else all_text_features
    logits = logit_scale * image_features @ all_text.T + logit_bias  # (B, N)
    rows = torch.arange(image_features.shape[0], device=logits.device)  # (B,)
    labels = -torch.ones_like(logits)  # (B, N): -1 for negatives ...
    labels[rows, rows + offset] = 1.0  # ... +1 for each image's own caption
    return -F.logsigmoid(labels * logits).sum() / image_features.shape[0]


def mae_loss(
    target: torch.Tensor,
    pred: torch.Tensor,
    mask: torch.Tensor,
    norm_pix_loss: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Mean squared error on the masked patches only (MAE ``forward_loss``).

    MAE sec. 3: "we compute the loss only on masked patches"; with ``norm_pix_loss`` each
    target patch is normalised by its own pixel mean and variance (the released models' setting,
    which the paper's Table 1d finds improves representations).

    Args:
        target: (B, L, p*p*C) true pixels per patch (``mmssl.models.masking.patchify`` of the
            images; patches rather than images so this module imports nothing from ``models``).
        pred: (B, L, p*p*C) predicted pixels per patch.
        mask: (B, L), 1 = masked (loss counted), 0 = visible (ignored).
        norm_pix_loss: normalise each target patch to zero mean, unit variance.
        eps: added to the variance, as in MAE.

    Returns:
        Scalar loss: the per-patch mean squared error averaged over masked patches.
    """
    if target.shape != pred.shape:
        raise ValueError(f"mae_loss: target {tuple(target.shape)} and pred {tuple(pred.shape)} differ")
    target = target.float()
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)  # (B, L, 1)
        var = target.var(dim=-1, keepdim=True)  # unbiased, as MAE's torch.var
        target = (target - mean) / (var + eps) ** 0.5
    loss = (pred.float() - target).pow(2).mean(dim=-1)  # (B, L) per-patch MSE
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp_min(1.0)
