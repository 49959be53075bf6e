"""Recall@K of hand-built retrievals, where the place of each query's own pair is known."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mmssl.retrieval import distributed_retrieval_hits, retrieval_hits, retrieval_metrics

N = 12
# The place (0 = first) of each query's own pair among the N candidates. Places 1, 5 and 10 sit
# exactly on the cut-offs: recall@K counts the pairs placed 0..K-1, so K itself is a miss.
PLACES = [0, 1, 4, 5, 9, 10, 11, 0, 3, 7, 2, 6]


def _queries(places: list[int]) -> torch.Tensor:
    """(N, N) L2-normalised queries against the one-hot candidates: query i's scores descend
    over the candidates with its own (candidate i) at ``places[i]``."""
    rows = []
    for i, place in enumerate(places):
        order = [c for c in range(N) if c != i]
        order.insert(place, i)
        scores = torch.empty(N)
        scores[torch.tensor(order)] = torch.linspace(1.0, 0.1, N)
        rows.append(scores)
    return F.normalize(torch.stack(rows), dim=-1)


def test_recall_counts_the_places_below_k():
    queries, candidates = _queries(PLACES), torch.eye(N)
    hits = retrieval_hits(queries, candidates, torch.arange(N), ks=(1, 2, 5, 10, 11), block=5)
    for column, k in enumerate((1, 2, 5, 10, 11)):
        assert hits[:, column].tolist() == [float(p < k) for p in PLACES], k
    metrics = retrieval_metrics(queries, candidates)
    assert metrics["i2t_R@1"] == pytest.approx(2 / N)  # places 0, 0
    assert metrics["i2t_R@5"] == pytest.approx(6 / N)  # places 0, 1, 4, 0, 3, 2
    assert metrics["i2t_R@10"] == pytest.approx(10 / N)  # all but places 10, 11


def test_ties_rank_the_lower_candidate_index_first():
    # Query 0 ties candidates 1 and 3 (its own pair is 3): candidate 1 comes first, so it is second.
    queries = F.normalize(torch.tensor([[0.0, 1.0, 0.0, 1.0]]), dim=-1)
    hits = retrieval_hits(queries, torch.eye(4), torch.tensor([3]), ks=(1, 2))
    assert hits.tolist() == [[0.0, 1.0]]
    hits = retrieval_hits(queries, torch.eye(4), torch.tensor([1]), ks=(1, 2))  # own pair first of the tie
    assert hits.tolist() == [[1.0, 1.0]]


def test_one_process_distributed_hits_are_the_hits_of_both_directions():
    # Without a process group every pair is this rank's: the hits of the whole set, per pair.
    # Three zero columns make D (15) differ from N (12), so a row count is never read off D.
    image, text = (F.pad(x, (0, 3)) for x in (_queries(PLACES), torch.eye(N)))
    hits = distributed_retrieval_hits(image, text)
    assert sorted(hits) == sorted(f"{d}_R@{k}" for d in ("i2t", "t2i") for k in (1, 5, 10))
    for column, k in enumerate((1, 5, 10)):
        assert hits[f"i2t_R@{k}"].tolist() == [float(p < k) for p in PLACES], k
        want = retrieval_hits(text, image, torch.arange(N), ks=(k,))[:, 0]
        assert torch.equal(hits[f"t2i_R@{k}"], want), k
    metrics = retrieval_metrics(image, text)
    assert {name: float(h.mean()) for name, h in hits.items()} == pytest.approx(metrics)
    assert hits["t2i_R@1"].tolist() != hits["i2t_R@1"].tolist()  # the directions really differ here


def _tied_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Six pairs: captions 1 and 4 identical (two images of one kind), images 2 and 5 identical."""
    e = torch.eye(8)
    image = torch.stack([e[0], e[1], e[2], e[3], F.normalize(e[1] + 0.1 * e[4], dim=0), e[2]])
    text = torch.stack([e[0], e[1], e[2], e[3], e[1], F.normalize(e[2] + 0.1 * e[5], dim=0)])
    return image, text


def test_ties_follow_one_convention_in_validation_and_the_suite(caplog, monkeypatch):
    from mmssl import retrieval
    from mmssl.evaluation import protocols
    from mmssl.retrieval import tied_rows

    monkeypatch.setattr(retrieval, "_reported", set())  # the counts are logged once per process

    image, text = _tied_pairs()
    assert (tied_rows(text), tied_rows(image)) == (2, 2)
    # Image 4 ties its own caption with caption 1 (identical): the lower index comes first, so it
    # misses at k = 1; image 5 scores caption 2 above its own. Caption 4 ranks image 1 first (no
    # tie), caption 5 ties images 2 and 5 (identical) and finds image 2 first.
    want_i2t, want_t2i = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    lightning_log = logging.getLogger("lightning.pytorch")  # it does not propagate to the root
    lightning_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO"):
            hits = distributed_retrieval_hits(image, text)
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert hits["i2t_R@1"].tolist() == want_i2t and hits["t2i_R@1"].tolist() == want_t2i
    assert hits["i2t_R@5"].tolist() == [1.0] * 6
    assert "of 6 held-out pairs, 2 captions and 2 images repeat" in caplog.text
    # The suite's retrieval (tools/evaluate.py), one caption per image: the same hits per unit.
    figures = protocols.retrieval(image, text, torch.arange(6), [1, 5])
    assert figures["text_retrieval_recall@1"].point() == pytest.approx(sum(want_i2t) / 6)
    assert figures["image_retrieval_recall@1"].point() == pytest.approx(sum(want_t2i) / 6)
    # Swapping pairs 1 and 4 moves the hit to the pair now first of the tie (old pair 4): the
    # order decides, not the sort's chance.
    swap = torch.tensor([0, 4, 2, 3, 1, 5])
    assert distributed_retrieval_hits(image[swap], text[swap])["i2t_R@1"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
