"""Image-text retrieval recall@K of held-out pairs, per query, in blocks.

open_clip_train's ``get_clip_metrics`` (what open_clip logs as ``image_to_text_R@1``) builds the
whole N x N similarity and argsorts it, on every rank: ~10 GB for 50k pairs. Here each query only
needs the number of candidates that outrank its own pair, so the similarity is computed a block of
queries at a time (memory ``block x N``), and each rank scores only its own queries: the hits are
then summed over ranks like any other metric. Ties are broken by candidate index, as a stable
descending sort would (open_clip's ``argsort`` leaves them to the sort), so the figure does not
depend on how the queries were split over ranks.

Ground floor (torch and ``mmssl.distributed``): the CLIP model's validation and the evaluation
tools both score with it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mmssl.distributed import gather_with_grad, rank

RECALL_AT = (1, 5, 10)


@torch.no_grad()
def retrieval_hits(
    queries: Tensor, candidates: Tensor, targets: Tensor, ks: Sequence[int] = RECALL_AT, block: int = 1024
) -> Tensor:
    """Whether each query's own pair ranks within the top k of all candidates.

    Args:
        queries: (n, D) L2-normalised query embeddings.
        candidates: (N, D) L2-normalised candidate embeddings.
        targets: (n,) index in ``candidates`` of each query's pair.
        ks: the cut-offs.
        block: queries scored at once.

    Returns:
        (n, len(ks)) float 0/1 hits.
    """
    hits = []
    for start in range(0, queries.shape[0], block):
        q, t = queries[start:start + block].float(), targets[start:start + block]
        scores = q @ candidates.float().t()  # (b, N)
        own = scores.gather(1, t[:, None])  # (b, 1)
        before = torch.arange(candidates.shape[0], device=scores.device)[None, :] < t[:, None]  # (b, N)
        rank = ((scores > own) | ((scores == own) & before)).sum(dim=1)  # (b,) 0 = first
        hits.append(torch.stack([rank < k for k in ks], dim=1).float())
    return torch.cat(hits) if hits else queries.new_zeros(0, len(ks))


def distributed_retrieval_hits(image: Tensor, text: Tensor) -> dict[str, Tensor]:
    """This rank's hits in the retrieval of the held-out set spread over all ranks.

    Every rank gathers the candidates of every pair but scores only its own queries, so summing
    the hits over ranks (a sum-and-count metric) gives the figure of one process on the whole
    set. Call it on every rank, with ``n_r = 0`` rows on a rank without pairs.

    Args:
        image: (n_r, D) L2-normalised image embeddings of this rank's pairs.
        text: (n_r, D) L2-normalised text embeddings, row i paired with image row i.

    Returns:
        ``{"i2t_R@1": (n_r,) 0/1 hits, ..., "t2i_R@10": ...}``.
    """
    owner = gather_with_grad(torch.full((image.shape[0],), rank(), device=image.device))  # (N,)
    mine = (owner == rank()).nonzero().squeeze(1)  # global index of each local pair
    all_image, all_text = gather_with_grad(image), gather_with_grad(text)  # (N, D)
    out = {}
    for name, queries, candidates in (("i2t", image, all_text), ("t2i", text, all_image)):
        hits = retrieval_hits(queries, candidates, mine)  # (n_r, len(RECALL_AT))
        out.update({f"{name}_R@{k}": hits[:, i] for i, k in enumerate(RECALL_AT)})
    return out


def retrieval_metrics(image_features: Tensor, text_features: Tensor) -> dict[str, float]:
    """Image->text and text->image recall@1/5/10 of pairs on one process, pair i matching pair i.

    Args:
        image_features: (N, D) L2-normalised image embeddings.
        text_features: (N, D) L2-normalised text embeddings, row i paired with image i.

    Returns:
        ``{"i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", ...}`` in [0, 1].
    """
    targets = torch.arange(image_features.shape[0], device=image_features.device)
    out = {}
    for name, queries, candidates in (("i2t", image_features, text_features), ("t2i", text_features, image_features)):
        recall = retrieval_hits(queries, candidates, targets).mean(dim=0)
        out.update({f"{name}_R@{k}": float(r) for k, r in zip(RECALL_AT, recall)})
    return out
