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
