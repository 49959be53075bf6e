"""Losses as pure functions of tensors: no module state, no rank or world size."""

from __future__ import annotations

import torch


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
