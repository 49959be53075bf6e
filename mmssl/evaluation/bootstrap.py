"""Bootstrap intervals of evaluation figures, and the paired bootstrap of a difference.

A figure of a labelled set (accuracy, mean per-class recall, retrieval recall@k) is a function of
per-unit outcomes: a unit is a test image (for retrieval: an image with its captions). The
non-parametric bootstrap (Efron & Tibshirani 1993, ch. 13, percentile interval) redraws the units
with replacement; a draw is a vector of counts ``w`` (R, U), and each figure is computed on the
weighted units, so every figure of one set is scored on the same draws. Comparing two models on
the same units with the same draws is the paired bootstrap (Koehn 2004, "Statistical significance
tests for machine translation evaluation"): the interval of ``B - A`` and how often a draw has
``B <= A``.

Written here rather than with ``scipy.stats.bootstrap`` (not a dependency) or torchmetrics'
``BootStrapper`` (which redraws per update batch and keeps no paired draws). The draws come from a
``torch.Generator`` seeded by the caller: the same seed gives the same intervals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

CONFIDENCE = 0.95


def draw_counts(num_units: int, resamples: int, seed: int) -> Tensor:
    """Bootstrap draws as counts: row r says how often each unit is in draw r.

    Args:
        num_units: U.
        resamples: R.
        seed: seeds the draws (an own generator: the global RNG is untouched).

    Returns:
        (R, U) float32 counts, each row summing to U.
    """
    generator = torch.Generator().manual_seed(seed)
    if num_units == 0:
        return torch.zeros(resamples, 0)
    counts = torch.zeros(resamples, num_units)
    picks = torch.randint(num_units, (resamples, num_units), generator=generator)  # (R, U) unit ids
    return counts.scatter_add_(1, picks, torch.ones(resamples, num_units))


class Figure(ABC):
    """A figure computed on weighted units: ``values(w)`` (R, U) -> (R,); ``w`` of ones is the figure itself."""

    @abstractmethod
    def values(self, weights: Tensor) -> Tensor:
        """The figure under each row of unit weights: (R, U) -> (R,)."""

    @abstractmethod
    def select(self, positions: Tensor) -> "Figure":
        """The same figure on a subset of the units (in ``positions`` order)."""

    def point(self) -> float:
        """The figure on all units."""
        num_units = self.num_units()
        return float(self.values(torch.ones(1, num_units))[0])

    @abstractmethod
    def num_units(self) -> int:
        """How many units the figure is computed on."""


@dataclass
class Ratio(Figure):
    """sum(w * numerator) / sum(w * denominator): accuracy (numerator 0/1, denominator 1), or the
    recall of a unit's several queries (numerator = hits among them, denominator = their count)."""

    numerator: Tensor  # (U,)
    denominator: Tensor  # (U,)

    def values(self, weights: Tensor) -> Tensor:
        weights = weights.double()
        den = weights @ self.denominator.double()  # (R,)
        return (weights @ self.numerator.double()) / den.clamp_min(1e-12)

    def select(self, positions: Tensor) -> "Ratio":
        return Ratio(self.numerator[positions], self.denominator[positions])

    def num_units(self) -> int:
        return int(self.numerator.shape[0])


@dataclass
class ClassRecall(Figure):
    """Mean per-class recall (scikit-learn's ``balanced_accuracy_score``, what CLIP_benchmark
    reports as ``mean_per_class_recall``): the mean over the classes present of the fraction right."""

    correct: Tensor  # (U,) 0/1
    labels: Tensor  # (U,) class indices
    num_classes: int

    def values(self, weights: Tensor) -> Tensor:
        weights = weights.double()
        onehot = torch.nn.functional.one_hot(self.labels.long(), self.num_classes).double()  # (U, C)
        right = weights @ (onehot * self.correct.double()[:, None])  # (R, C)
        seen = weights @ onehot  # (R, C) weight of each class in the draw
        present = seen > 0
        recall = torch.where(present, right / seen.clamp_min(1e-12), torch.zeros_like(seen))
        return recall.sum(dim=1) / present.sum(dim=1).clamp_min(1)

    def select(self, positions: Tensor) -> "ClassRecall":
        return ClassRecall(self.correct[positions], self.labels[positions], self.num_classes)

    def num_units(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class MeanOf(Figure):
    """The mean of figures over the same units (DataComp's retrieval score: mean of both recalls@1)."""

    parts: Sequence[Figure]

    def values(self, weights: Tensor) -> Tensor:
        return torch.stack([p.values(weights) for p in self.parts]).mean(dim=0)

    def select(self, positions: Tensor) -> "MeanOf":
        return MeanOf([p.select(positions) for p in self.parts])

    def num_units(self) -> int:
        return self.parts[0].num_units()


def percentile_interval(draws: Tensor, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of bootstrap draws (R,): the (1-c)/2 and (1+c)/2 quantiles."""
    if draws.numel() == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - confidence) / 2
    low, high = torch.quantile(draws.double(), torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    return float(low), float(high)


def bootstrap_draws(figures: dict[str, Figure], weights: Tensor) -> dict[str, Tensor]:
    """Each figure on every draw: name -> (R,)."""
    return {name: fig.values(weights).float() for name, fig in figures.items()}


@dataclass
class PairedDifference:
    """B - A on the same units and draws.

    Attributes:
        a, b: the figures on all shared units.
        difference: ``b - a``.
        low, high: its percentile interval.
        p_value: two-sided: twice the smaller share of draws on either side of zero (at most 1).
        num_units: the units both were scored on.
    """

    a: float
    b: float
    difference: float
    low: float
    high: float
    p_value: float
    num_units: int


def paired_difference(a: Figure, a_units: Tensor, b: Figure, b_units: Tensor, resamples: int, seed: int,
                      confidence: float = CONFIDENCE) -> PairedDifference:
    """Paired bootstrap of ``b - a`` over the units both were scored on.

    Args:
        a, b: the same figure of two models.
        a_units, b_units: (U_a,), (U_b,) each unit's id in the set (samples one model could not
            read are missing from its ids; only shared ids are compared).
        resamples: R.
        seed: seeds the draws.
        confidence: of the interval.

    Returns:
        The difference, its interval and p-value.
    """
    shared, a_pos, b_pos = _shared_positions(a_units, b_units)
    fa, fb = a.select(a_pos), b.select(b_pos)
    weights = draw_counts(int(shared.numel()), resamples, seed).double()
    diff = fb.values(weights) - fa.values(weights)  # (R,)
    low, high = percentile_interval(diff, confidence)
    below, above = float((diff <= 0).double().mean()), float((diff >= 0).double().mean())
    pa, pb = fa.point(), fb.point()
    return PairedDifference(pa, pb, pb - pa, low, high, min(1.0, 2 * min(below, above)), int(shared.numel()))


def _shared_positions(a_units: Tensor, b_units: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Ids in both, and their positions in ``a_units`` and ``b_units`` (sorted by id)."""
    a_sorted, a_order = torch.sort(a_units)
    b_sorted, b_order = torch.sort(b_units)
    shared = a_sorted[torch.isin(a_sorted, b_sorted)]
    a_pos = a_order[torch.searchsorted(a_sorted, shared)]
    b_pos = b_order[torch.searchsorted(b_sorted, shared)]
    return shared, a_pos, b_pos
