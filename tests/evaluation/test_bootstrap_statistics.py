"""The bootstrap tested as statistics (mmssl.evaluation.bootstrap, report): seeded simulations show
that every kind of figure the suite reports with a 95% interval (accuracy, a recall over units with
several captions, mean per-class recall, the mean of two recalls, the suite average over sets)
covers its true value about 95% of the time; the paired difference's sign, interval and p-value on
constructed cases and under the null; and what the report files write of them."""

from __future__ import annotations

import csv
import json
from typing import Callable

import pytest
import torch

from mmssl.evaluation.bootstrap import (
    ClassRecall,
    Figure,
    MeanOf,
    Ratio,
    draw_counts,
    paired_difference,
    percentile_interval,
)
from mmssl.evaluation.report import compare, suite_average, write_report
from mmssl.evaluation.runner import Result, set_seed

REPS, UNITS, RESAMPLES = 400, 200, 400  # sigma of a 95% coverage over 400 repetitions: 1.1 points
COVERED = (0.925, 0.975)  # a 90% interval (5th / 95th percentiles) covers ~0.90: outside


def _coverage(make: Callable[[torch.Generator], Figure], truth: float, seed: int) -> tuple[float, float]:
    """Share of REPS simulated sets whose 95% interval holds ``truth``, and the mean width."""
    g = torch.Generator().manual_seed(seed)
    hits, width = 0, 0.0
    for rep in range(REPS):
        figure: Figure = make(g)
        low, high = percentile_interval(figure.values(draw_counts(figure.num_units(), RESAMPLES, seed * REPS + rep)))
        hits += low <= truth <= high
        width += (high - low) / REPS
    return hits / REPS, width


def _bernoulli(p: float, n: int, g: torch.Generator) -> torch.Tensor:
    return (torch.rand(n, generator=g) < p).float()


def _accuracy(g: torch.Generator, p: float = 0.7, n: int = UNITS) -> Ratio:
    return Ratio(_bernoulli(p, n, g), torch.ones(n))


def _recall_of_captions(g: torch.Generator) -> Ratio:
    """Images with 1-3 captions, each caption's image found with probability 0.6: recall 0.6."""
    captions = torch.randint(1, 4, (UNITS,), generator=g).float()
    hits = (torch.rand(UNITS, 3, generator=g) < 0.6).float()
    hits = (hits * (torch.arange(3)[None, :] < captions[:, None])).sum(dim=1)
    return Ratio(hits, captions)


RATES = torch.tensor([0.9, 0.5, 0.7, 0.3])  # per class: mean per-class recall 0.6


def _class_recall(g: torch.Generator) -> ClassRecall:
    labels = torch.randint(0, 4, (UNITS,), generator=g)
    return ClassRecall((torch.rand(UNITS, generator=g) < RATES[labels]).float(), labels, 4)


def _mean_of(g: torch.Generator) -> MeanOf:
    return MeanOf([_accuracy(g, 0.7), _recall_of_captions(g)])  # (0.7 + 0.6) / 2


@pytest.mark.parametrize("make, truth", [(_accuracy, 0.7), (_recall_of_captions, 0.6), (_class_recall, 0.6),
                                         (_mean_of, 0.65)], ids=["accuracy", "recall", "class_recall", "mean_of"])
def test_95_percent_intervals_cover_the_true_figure_95_percent_of_the_time(make, truth):
    coverage, width = _coverage(make, truth, seed=4)
    assert COVERED[0] <= coverage <= COVERED[1], coverage
    if make is _accuracy:  # the normal approximation's width: 2 x 1.96 x sqrt(p (1 - p) / n)
        assert width == pytest.approx(2 * 1.96 * (0.7 * 0.3 / UNITS) ** 0.5, rel=0.08)


def test_the_percentile_interval_is_at_the_2_5th_and_97_5th_percentiles():
    order = torch.randperm(4001, generator=torch.Generator().manual_seed(0))
    draws = torch.linspace(0, 1, 4001, dtype=torch.float64)[order]
    assert percentile_interval(draws) == pytest.approx((0.025, 0.975), abs=1e-9)
    assert percentile_interval(draws, 0.9) == pytest.approx((0.05, 0.95), abs=1e-9)


def test_every_unit_is_drawn_with_probability_one_over_the_units():
    units, resamples = 5, 4000
    counts = draw_counts(units, resamples, seed=0)  # multinomial(U, 1/U): mean 1, variance 1 - 1/U per unit
    assert torch.all(counts.sum(dim=1) == units)
    torch.testing.assert_close(counts.mean(dim=0), torch.ones(units), rtol=0, atol=0.05)
    torch.testing.assert_close(counts.var(dim=0), torch.full((units,), 1 - 1 / units), rtol=0, atol=0.06)
    assert counts[:, -1].max() >= 3  # the last unit too, sometimes several times


def _replicate(a: Figure, b: Figure, resamples: int, seed: int) -> torch.Tensor:
    w = draw_counts(a.num_units(), resamples, seed).double()
    return b.values(w) - a.values(w)


def test_the_paired_difference_interval_and_p_value_are_those_of_the_paired_draws():
    g = torch.Generator().manual_seed(2)
    a = _accuracy(g, 0.6)
    b = Ratio(torch.where(torch.rand(UNITS, generator=g) < 0.1, 1 - a.numerator, a.numerator), torch.ones(UNITS))
    units = torch.arange(UNITS)
    got = paired_difference(a, units, b, units, 500, seed=7)
    d = _replicate(a, b, 500, seed=7)
    assert (got.low, got.high) == pytest.approx(percentile_interval(d))
    two_sided = min(1.0, 2 * min(float((d <= 0).double().mean()), float((d >= 0).double().mean())))
    assert got.p_value == pytest.approx(two_sided) and got.difference == pytest.approx(b.point() - a.point())
    flipped = paired_difference(b, units, a, units, 500, seed=7)  # A - B: the mirror image
    assert flipped.difference == pytest.approx(-got.difference) and flipped.p_value == pytest.approx(got.p_value)
    assert (flipped.low, flipped.high) == pytest.approx((-got.high, -got.low))


def test_a_small_sure_improvement_is_significant_only_because_the_draws_are_paired():
    """B is A with 8 more of 400 units right (+2 points): every draw that holds one of them shows
    B ahead, so the paired interval is above 0 and p tiny; unpaired draws (sd ~3.5 points) could not tell."""
    a_right = torch.arange(400) % 2 == 0
    b_right = a_right | (torch.arange(400) < 16)  # units 1, 3, ..., 15 turn right
    a, b, units = Ratio(a_right.float(), torch.ones(400)), Ratio(b_right.float(), torch.ones(400)), torch.arange(400)
    diff = paired_difference(a, units, b, units, 1000, seed=0)
    assert diff.difference == pytest.approx(0.02) and diff.low > 0 and diff.p_value < 0.01
    worse = paired_difference(b, units, a, units, 1000, seed=0)
    assert worse.difference == pytest.approx(-0.02) and worse.high < 0 and worse.p_value < 0.01


def test_p_values_of_equally_good_models_are_uniform():
    """A and B right independently with the same probability on each unit: about 5% of p < 0.05."""
    g = torch.Generator().manual_seed(3)
    units = torch.arange(UNITS)
    p_values = []
    for rep in range(200):
        a, b = _accuracy(g, 0.7), _accuracy(g, 0.7)
        p_values.append(paired_difference(a, units, b, units, 400, seed=rep).p_value)
    p = torch.tensor(p_values)
    assert 0.02 <= float((p < 0.05).float().mean()) <= 0.08
    assert 0.4 <= float(p.mean()) <= 0.6  # a uniform p's mean is 1/2


def _result(name: str, figure: Figure, resamples: int, seed: int = 0, task: str = "zero_shot") -> Result:
    weights = draw_counts(figure.num_units(), resamples, set_seed(seed, name))
    metric = {"zero_shot": "acc1", "retrieval": "mean_recall@1"}[task]
    return Result(name, task, "clip", {metric: figure}, torch.arange(figure.num_units()),
                  {metric: figure.values(weights).float()}, num_samples=figure.num_units())


def test_the_suite_average_interval_covers_the_mean_of_the_sets_true_figures():
    """Four sets of 100 units (accuracies 0.5 .. 0.8): the average's interval covers 0.65 ~95% of the
    time, and is about half as wide as one set's (independent draws: sd / sqrt(4))."""
    g = torch.Generator().manual_seed(4)
    truths = (0.5, 0.6, 0.7, 0.8)
    hits, width = 0, 0.0
    for rep in range(300):
        results = [_result(f"set{i}", _accuracy(g, p, 100), 300, seed=rep) for i, p in enumerate(truths)]
        [row] = suite_average(results)
        assert row["value"] == pytest.approx(sum(r.metrics()["acc1"] for r in results) / 4)
        hits += row["ci95"][0] <= 0.65 <= row["ci95"][1]
        width += (row["ci95"][1] - row["ci95"][0]) / 300
    assert 0.92 <= hits / 300 <= 0.98, hits / 300
    one_set = 2 * 1.96 * (0.65 * 0.35 / 100) ** 0.5
    assert width == pytest.approx(one_set / 2, rel=0.12)


def test_the_report_writes_each_figures_interval_and_the_comparisons_sign(tmp_path):
    g = torch.Generator().manual_seed(5)
    a_fig, b_fig = _accuracy(g, 0.5), _accuracy(g, 0.5)
    b_fig = Ratio(torch.maximum(a_fig.numerator, (torch.arange(UNITS) % 4 == 0).float()), torch.ones(UNITS))
    a = [_result("s", a_fig, 200), _result("t", _mean_of(g), 200, task="retrieval")]
    b = [_result("s", b_fig, 200)]
    summary = write_report(a, str(tmp_path), "m", "a.pt", 200, 0, "T")
    for r, doc in zip(a, summary["results"]):
        name = next(iter(r.figures))
        assert doc["ci95"][name] == pytest.approx(list(percentile_interval(r.draws[name])))
        assert doc["metrics"][name] == pytest.approx(r.figures[name].point())
        assert doc["bootstrap"]["interval"] == "percentile, 95%"
        assert json.loads((tmp_path / f"{r.set}_{r.task}_clip.json").read_text())["ci95"] == doc["ci95"]
    rows = {row["set"]: row for row in csv.DictReader((tmp_path / "results.csv").open())}
    low, high = percentile_interval(a[0].draws["acc1"])
    assert float(rows["s"]["ci95_low"]) == pytest.approx(low, abs=1e-6)
    assert float(rows["s"]["ci95_high"]) == pytest.approx(high, abs=1e-6)
    table = (tmp_path / "results.md").read_text()
    assert f"{100 * a[0].metrics()['acc1']:.2f} [{100 * low:.2f}, {100 * high:.2f}]" in table
    assert [(row["task"], row["value"]) for row in summary["suite_average"]] == [
        ("zero_shot", pytest.approx(a[0].metrics()["acc1"])),
        ("retrieval", pytest.approx(a[1].metrics()["mean_recall@1"]))]
    [row] = compare(a, b, 300, seed=0)  # B right on every unit A is, and on more: B - A > 0
    want = paired_difference(a_fig, a[0].units, b_fig, b[0].units, 300, set_seed(0, "s"))
    assert row["difference"] == pytest.approx(b_fig.point() - a_fig.point()) and row["difference"] > 0.05
    assert row["ci95"] == pytest.approx([want.low, want.high]) and row["ci95"][0] > 0
    assert row["p_value"] == pytest.approx(want.p_value) and row["p_value"] < 0.01
    assert (row["a"], row["b"]) == pytest.approx((a_fig.point(), b_fig.point()))
