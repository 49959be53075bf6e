"""Image-text retrieval recall@K of held-out pairs, per query, in blocks.

open_clip_train's ``get_clip_metrics`` (what open_clip logs as ``image_to_text_R@1``) builds the
whole N x N similarity and argsorts it, on every rank: ~10 GB for 50k pairs. Here each query only
needs the number of candidates that outrank its own pair, so the similarity is computed a block of
queries at a time (memory ``block x N``), and each rank scores only its own queries: the hits are
then summed over ranks like any other metric.

Ties, the one convention of mmssl (training validation and ``tools/evaluate.py`` alike): as in
CLIP_benchmark's ``zeroshot_retrieval``, a query's positives are its own pair(s) only, so a
repeated caption (or image) of another pair is a negative that scores exactly as the own one;
equal scores are then ordered by candidate index, as a stable descending sort orders them.
CLIP_benchmark (``torch.topk``) and open_clip_train (``torch.argsort``) leave that order to the
sort, which on ties is unspecified and differs between the two and between devices; the stable
order makes the figure reproducible and independent of how the queries are split over ranks.
With repeated captions (the demo's) recall is thus lower than when any identical caption counted;
:func:`tied_rows` counts the held-out items concerned.

Ground floor (torch and ``mmssl.distributed``): the CLIP model's validation and the evaluation
tools both score with it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mmssl.distributed import gather_with_grad, rank

RECALL_AT = (1, 5, 10)
_reported: set[tuple[int, int, int]] = set()


def places(scores: Tensor, targets: Tensor) -> Tensor:
    """Where each query's own candidate ranks: the candidates scored higher, plus those scored
    equal at a lower index (a stable descending sort's order; see the module docstring).

    Args:
        scores: (b, N) similarities of b queries to N candidates.
        targets: (b,) index of each query's own candidate.

    Returns:
        (b,) places, 0 = first.
    """
    own = scores.gather(1, targets[:, None])  # (b, 1)
    before = torch.arange(scores.shape[1], device=scores.device)[None, :] < targets[:, None]  # (b, N)
    return ((scores > own) | ((scores == own) & before)).sum(dim=1)


def tied_rows(embeddings: Tensor) -> int:
    """How many rows equal another row exactly (a repeated caption or image): each such item ties
    with its duplicates, and is found only when it comes first of them (see the module docstring).

    Args:
        embeddings: (N, D) embeddings of one modality.

    Returns:
        The number of rows in groups of two or more identical rows.
    """
    if embeddings.shape[0] == 0:
        return 0
    _, inverse, counts = torch.unique(embeddings, dim=0, return_inverse=True, return_counts=True)
    return int((counts[inverse] > 1).sum())


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
        rank = places(q @ candidates.float().t(), t)  # (b,) of (b, N) scores; 0 = first
        hits.append(torch.stack([rank < k for k in ks], dim=1).float())
    return torch.cat(hits) if hits else queries.new_zeros(0, len(ks))


def distributed_retrieval_hits(image: Tensor, text: Tensor) -> dict[str, Tensor]:
    """This rank's hits in the retrieval of the held-out set spread over all ranks.

    Every rank gathers the candidates of every pair but scores only its own queries, so summing
    the hits over ranks (a sum-and-count metric) gives the figure of one process on the whole
    set. Call it on every rank, with ``n_r = 0`` rows on a rank without pairs. Rank 0 logs, once
    per set, how many of the pairs' captions and images tie with another's (:func:`tied_rows`).

    Args:
        image: (n_r, D) L2-normalised image embeddings of this rank's pairs.
        text: (n_r, D) L2-normalised text embeddings, row i paired with image row i.

    Returns:
        ``{"i2t_R@1": (n_r,) 0/1 hits, ..., "t2i_R@10": ...}``.
    """
    owner = gather_with_grad(torch.full((image.shape[0],), rank(), device=image.device))  # (N,)
    mine = (owner == rank()).nonzero().squeeze(1)  # global index of each local pair
    all_image, all_text = gather_with_grad(image), gather_with_grad(text)  # (N, D)
    if rank() == 0:
        _report_ties(all_image, all_text)
    out = {}
    for name, queries, candidates in (("i2t", image, all_text), ("t2i", text, all_image)):
        hits = retrieval_hits(queries, candidates, mine)  # (n_r, len(RECALL_AT))
        out.update({f"{name}_R@{k}": hits[:, i] for i, k in enumerate(RECALL_AT)})
    return out


def _report_ties(image: Tensor, text: Tensor) -> None:
    """Log the held-out set's tied items once per distinct count (validation runs every epoch)."""
    from lightning.pytorch.utilities import rank_zero_info  # the console Lightning's own notices reach

    counts = (image.shape[0], tied_rows(text), tied_rows(image))
    if counts[0] and counts not in _reported:
        _reported.add(counts)
        rank_zero_info(f"retrieval: of {counts[0]} held-out pairs, {counts[1]} captions and {counts[2]} images "
                       "repeat another pair's exactly; a tie ranks the lower index first (mmssl.retrieval)")


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
