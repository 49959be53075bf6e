"""The suite's zero-shot protocol (mmssl.evaluation.protocols.zero_shot) against a hand computation:
top-1, top-5 (from 5 classes on, as CLIP_benchmark) and mean per-class recall of the images'
normalised embeddings against a (D, C) classifier, D != C (top-5 of exactly 5 classes is 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmssl.evaluation import protocols


def _hand(features: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor) -> dict[str, float]:
    logits = F.normalize(features, dim=-1) @ classifier  # (N, C)
    order = logits.argsort(dim=1, descending=True)
    top1 = [int(order[i, 0]) == int(labels[i]) for i in range(len(labels))]
    top5 = [int(labels[i]) in order[i, :5].tolist() for i in range(len(labels))]
    recalls = [sum(t for t, y in zip(top1, labels.tolist()) if y == c) / labels.tolist().count(c)
               for c in sorted(set(labels.tolist()))]
    return {"acc1": sum(top1) / len(top1), "acc5": sum(top5) / len(top5),
            "mean_per_class_recall": sum(recalls) / len(recalls)}


@pytest.mark.parametrize("classes", [8, 5, 4])
def test_zero_shot_figures_are_the_hand_computed_ones(classes):
    g = torch.Generator().manual_seed(0)
    n, dim = 40, 7
    counts = {8: (10, 8, 8, 6, 4, 4), 5: (20, 12, 8), 4: (16, 12, 8, 4)}[classes]  # unequal; not all present
    labels = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    classifier = F.normalize(torch.randn(dim, classes, generator=g), dim=0)  # (D, C)
    # images near their class's column, some pulled towards another class, at varied norms
    features = classifier.T[labels] + 0.9 * torch.randn(n, dim, generator=g)
    features = features * torch.rand(n, 1, generator=g).mul(5).add(0.1)
    figures = protocols.zero_shot(features, labels, classifier)
    want = _hand(features, labels, classifier)
    assert set(figures) == ({"acc1", "acc5", "mean_per_class_recall"} if classes >= 5
                            else {"acc1", "mean_per_class_recall"})
    for name, fig in figures.items():
        assert fig.point() == pytest.approx(want[name]), name
    assert 0 < want["acc1"] < 1 and want["acc1"] != pytest.approx(want["mean_per_class_recall"])
    if classes == 8:
        assert want["acc1"] < want["acc5"] < 1
