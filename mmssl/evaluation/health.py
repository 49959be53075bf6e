"""Label-free health figures of an embedding: pure functions, tensors in, floats out.

- RankMe (Garrido et al. 2023, "RankMe: Assessing the downstream performance of pretrained
  self-supervised representations by their rank", eq. 1): the effective rank of an (N, D)
  embedding matrix, ``exp`` of the entropy of its normalised singular values. It lies in
  ``[1, min(N, D)]``; a collapsed embedding (all points on a line) scores about 1.
- Alignment and uniformity (Wang & Isola 2020, "Understanding contrastive representation
  learning through alignment and uniformity on the hypersphere", sec. 4.1): on L2-normalised
  features, ``E ||f(x) - f(y)||^alpha`` over positive pairs (lower: positives closer) and
  ``log E exp(-t ||f(x) - f(y)||^2)`` over all pairs (lower: spread more evenly on the sphere).
- Modality gap (Liang et al. 2022, "Mind the gap", sec. 3): the distance between the centroids
  of the L2-normalised image and text embeddings.

Computed in float64: the figures are compared across runs and process counts, and an SVD of a
few hundred rows costs milliseconds either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["alignment", "modality_gap", "rankme", "uniformity"]

# RankMe eq. 1 adds a small epsilon to each normalised singular value (the paper's 1e-7) so the
# entropy stays finite when some are zero.
RANKME_EPS = 1e-7


def _check_matrix(x: Tensor, name: str) -> None:
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty (N, D) matrix, got shape {tuple(x.shape)}")


def rankme(embeddings: Tensor, eps: float = RANKME_EPS) -> float:
    """Effective rank of ``embeddings`` (Garrido et al. 2023, eq. 1).

    ``p_k = sigma_k / ||sigma||_1 + eps``, ``RankMe = exp(-sum_k p_k log p_k)``, with
    ``sigma`` the singular values of the (uncentred) embedding matrix, as the paper computes it.

    Args:
        embeddings: (N, D), N samples.
        eps: the paper's epsilon.

    Returns:
        A float in about ``[1, min(N, D)]``; 0.0 for an all-zero matrix (no direction at all).
    """
    _check_matrix(embeddings, "rankme")
    sigma = torch.linalg.svdvals(embeddings.double())  # (min(N, D),)
    total = sigma.sum()
    if total <= 0:
        return 0.0
    p = sigma / total + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


def alignment(x: Tensor, y: Tensor, alpha: float = 2.0) -> float:
    """Wang & Isola's alignment ``E ||f(x_i) - f(y_i)||_2^alpha`` over positive pairs (x_i, y_i).

    Args:
        x: (N, D) features of the first element of each pair; L2-normalised here.
        y: (N, D) features of its positive (CLIP: the image's caption; an image model: another view).
        alpha: the exponent (the paper's default 2).

    Returns:
        A float in ``[0, 2^alpha]``: 0 when every pair coincides.
    """
    _check_matrix(x, "alignment")
    if x.shape != y.shape:
        raise ValueError(f"alignment: pairs need equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = F.normalize(x.double(), dim=-1), F.normalize(y.double(), dim=-1)
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity(x: Tensor, t: float = 2.0) -> float:
    """Wang & Isola's uniformity ``log E_{i<j} exp(-t ||f(x_i) - f(x_j)||_2^2)``.

    Args:
        x: (N, D) features, N >= 2; L2-normalised here.
        t: the Gaussian potential's scale (the paper's default 2).

    Returns:
        A float in ``[-4t, 0]``: 0 when all points coincide, lower when they spread out.
    """
    _check_matrix(x, "uniformity")
    if x.shape[0] < 2:
        raise ValueError(f"uniformity: needs at least 2 samples, got {x.shape[0]}")
    x = F.normalize(x.double(), dim=-1)
    # The paper's code: torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log(), over i < j.
    return float(torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log())


def modality_gap(image: Tensor, text: Tensor) -> float:
    """Liang et al.'s modality gap: ``|| mean_i img_i / ||img_i|| - mean_j txt_j / ||txt_j|| ||_2``.

    Args:
        image: (N, D) image embeddings.
        text: (M, D) text embeddings (the captions of the same images, or any text set).

    Returns:
        A float in ``[0, 2]``: 0 when both centroids coincide.
    """
    _check_matrix(image, "modality_gap")
    _check_matrix(text, "modality_gap")
    if image.shape[1] != text.shape[1]:
        raise ValueError(f"modality_gap: embedding widths differ, {image.shape[1]} and {text.shape[1]}")
    centre_image = F.normalize(image.double(), dim=-1).mean(dim=0)  # (D,)
    centre_text = F.normalize(text.double(), dim=-1).mean(dim=0)  # (D,)
    return float((centre_image - centre_text).norm())
