"""Losses as pure functions of tensors: no stored rank, world size or module state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def clip_loss(image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, Fig. 3), pair i matching pair i.

    Args:
        image_features: (B, D) L2-normalised image embeddings.
        text_features: (B, D) L2-normalised text embeddings, row i paired with image i.
        logit_scale: scalar, the temperature's inverse (already exponentiated).

    Returns:
        Scalar: mean of the image->text and text->image cross-entropies.
    """
    logits_per_image = logit_scale * image_features @ text_features.T  # (B, B)
    labels = torch.arange(image_features.shape[0], device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


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
