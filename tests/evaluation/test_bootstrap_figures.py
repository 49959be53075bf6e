"""Bootstrap figures beyond accuracy (mmssl.evaluation.bootstrap): the paired difference of mean
per-class recall and of a mean of recalls when one model could not read some units (only shared
units compared, each figure on the same units), every figure of a set on the same draws, a
confidence other than 95%, and the empty cases (no units, no draws, units without queries)."""

from __future__ import annotations

import math

import pytest
import torch

from mmssl.evaluation.bootstrap import (
    ClassRecall,
    MeanOf,
    Ratio,
    bootstrap_draws,
    draw_counts,
    paired_difference,
    percentile_interval,
)


def _recall(correct: list[int], labels: list[int], classes: int = 3) -> ClassRecall:
    return ClassRecall(torch.tensor(correct, dtype=torch.float32), torch.tensor(labels), classes)


def test_paired_class_recall_compares_only_the_units_both_read():
    labels = [0, 0, 1, 1, 2, 2, 2, 0]
    a = _recall([1, 0, 1, 0, 1, 1, 0, 1], labels)
    units = torch.arange(8)
    # B could not read units 1 and 6, and lists the rest in another order.
    b_units = torch.tensor([7, 5, 4, 3, 2, 0])
    b = _recall([1, 1, 1, 1, 1, 1], [labels[i] for i in b_units.tolist()])
    diff = paired_difference(a, units, b, b_units, 200, seed=0)
    shared_a = _recall([1, 1, 0, 1, 1, 1], [0, 1, 1, 2, 2, 0])  # A on units 0, 2, 3, 4, 5, 7
    assert diff.num_units == 6
    assert (diff.a, diff.b) == pytest.approx((shared_a.point(), 1.0))
    assert diff.difference == pytest.approx(1.0 - shared_a.point())


def test_paired_mean_of_recalls_selects_every_part_on_the_shared_units():
    hits_i, hits_t = [1, 0, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1]
    a = MeanOf([Ratio(torch.tensor(hits_i, dtype=torch.float32), torch.ones(6)),
                Ratio(torch.tensor(hits_t, dtype=torch.float32), torch.ones(6))])
    assert a.num_units() == 6 and a.point() == pytest.approx((4 / 6 + 4 / 6) / 2)
    b_units = torch.tensor([0, 1, 2])  # B read only the first three
    b = MeanOf([Ratio(torch.ones(3), torch.ones(3)), Ratio(torch.ones(3), torch.ones(3))])
    diff = paired_difference(a, torch.arange(6), b, b_units, 100, seed=1)
    assert diff.num_units == 3 and diff.a == pytest.approx((2 / 3 + 1 / 3) / 2) and diff.b == 1.0


def test_every_figure_of_a_set_is_scored_on_the_same_draws():
    figures = {"acc1": Ratio(torch.tensor([1.0, 0, 1, 0]), torch.ones(4)),
               "mean_per_class_recall": _recall([1, 0, 1, 0], [0, 0, 1, 1], 2)}
    weights = draw_counts(4, 30, seed=2)
    draws = bootstrap_draws(figures, weights)
    assert set(draws) == set(figures) and all(d.dtype == torch.float32 and d.shape == (30,) for d in draws.values())
    assert torch.equal(draws["acc1"], figures["acc1"].values(weights).float())
    assert torch.equal(draws["mean_per_class_recall"], figures["mean_per_class_recall"].values(weights).float())


def test_the_interval_of_a_difference_follows_the_confidence_asked_for():
    a = Ratio((torch.arange(300) % 2 == 0).float(), torch.ones(300))
    b = Ratio((torch.arange(300) % 3 == 0).float(), torch.ones(300))
    units = torch.arange(300)
    wide = paired_difference(a, units, b, units, 400, seed=3)
    narrow = paired_difference(a, units, b, units, 400, seed=3, confidence=0.5)
    w = draw_counts(300, 400, 3).double()
    d = b.values(w) - a.values(w)
    assert (narrow.low, narrow.high) == pytest.approx(percentile_interval(d, 0.5))
    assert wide.low < narrow.low < narrow.high < wide.high


def test_empty_cases_give_zero_counts_nan_intervals_and_no_division_by_zero():
    assert draw_counts(0, 5, seed=0).shape == (5, 0)
    low, high = percentile_interval(torch.zeros(0))
    assert math.isnan(low) and math.isnan(high)
    # Images without a caption weigh nothing in text retrieval: a draw of only those scores 0, not NaN.
    recall = Ratio(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert recall.values(torch.tensor([[0.0, 2.0], [1.0, 1.0]])).tolist() == [0.0, 1.0]
    # Two runs that share no unit: every figure of nothing is 0 on every draw, never an error.
    nothing = ClassRecall(torch.zeros(0), torch.zeros(0, dtype=torch.long), 3)
    assert nothing.values(torch.zeros(4, 0)).tolist() == [0.0] * 4
    # A mean of one figure is that figure.
    single = MeanOf([Ratio(torch.tensor([1.0, 0, 1]), torch.ones(3))])
    assert single.num_units() == 3 and single.point() == pytest.approx(2 / 3)
    # A class absent from a draw leaves the mean over the classes present.
    r = _recall([1, 0, 1], [0, 1, 2])
    assert r.values(torch.tensor([[3.0, 0, 0], [0, 3, 0], [1, 1, 1]])).tolist() == pytest.approx([1.0, 0.0, 2 / 3])
