"""Weighted k-nearest-neighbour classification on frozen features (DINO, Caron et al. 2021).

DINO's ``eval_knn.py`` (after Wu et al. 2018): cosine similarity to every training feature, the
k most similar vote for their class with weight exp(similarity / T); k = 20 and T = 0.07 are
DINO's defaults. No library offers this exact weighting (scikit-learn's k-NN weighs by inverse
distance), so it is written here, chunked over queries to bound memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def knn_scores(
    train_features: Tensor,
    train_labels: Tensor,
    query_features: Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> Tensor:
    """Class scores of each query from its k nearest training features.

    Args:
        train_features: (N, D) memory bank.
        train_labels: (N,) class indices.
        query_features: (Q, D).
        num_classes: C.
        k: neighbours (clipped to N).
        temperature: T in exp(cos / T).
        chunk_size: queries per similarity matrix, (chunk, N).

    Returns:
        (Q, C) summed neighbour weights per class; argmax is the prediction.
    """
    if train_features.shape[0] == 0:
        raise ValueError("k-NN needs at least one training feature")
    bank = F.normalize(train_features.float(), dim=1)  # (N, D)
    k = min(k, bank.shape[0])
    scores = []
    for start in range(0, query_features.shape[0], chunk_size):
        query = F.normalize(query_features[start : start + chunk_size].float(), dim=1)  # (q, D)
        similarity, index = (query @ bank.T).topk(k, dim=1)  # (q, k)
        weights = (similarity / temperature).exp()  # (q, k)
        votes = F.one_hot(train_labels[index], num_classes).float()  # (q, k, C)
        scores.append((votes * weights.unsqueeze(-1)).sum(dim=1))  # (q, C)
    if not scores:
        return torch.zeros(0, num_classes)
    return torch.cat(scores)
