"""The health figures against hand-written references (loops over pairs, the papers' formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from mmssl.evaluation.health import alignment, modality_gap, rankme, uniformity


def rankme_reference(z: torch.Tensor, eps: float = 1e-7) -> float:
    """Garrido et al. 2023, eq. 1, written out over the singular values."""
    sigma = [float(s) for s in torch.linalg.svdvals(z.double())]
    total = sum(sigma)
    p = [s / total + eps for s in sigma]
    return math.exp(-sum(pk * math.log(pk) for pk in p))


def unit(v: torch.Tensor) -> list[float]:
    norm = math.sqrt(sum(float(x) ** 2 for x in v))
    return [float(x) / norm for x in v]


def test_rankme_of_a_rank_one_set_is_one_and_of_an_isotropic_set_is_its_dim():
    direction = torch.randn(16)
    line = torch.randn(200, 1) * direction  # (200, 16), every row on one line
    assert rankme(line) == pytest.approx(1.0, abs=1e-3)
    eye = torch.eye(8).repeat(5, 1)  # (40, 8): equal singular values
    assert rankme(eye) == pytest.approx(8.0, rel=1e-5)
    gauss = torch.randn(4000, 16, generator=torch.Generator().manual_seed(0))
    assert 15.0 < rankme(gauss) <= 16.0
    assert rankme(torch.zeros(4, 3)) == 0.0


def test_rankme_matches_the_papers_formula_and_is_bounded_by_the_smaller_side():
    z = torch.randn(30, 12, generator=torch.Generator().manual_seed(1)) @ torch.diag(torch.linspace(0.1, 3, 12))
    assert rankme(z) == pytest.approx(rankme_reference(z), rel=1e-9)
    few = torch.randn(5, 64)
    assert rankme(few) <= 5.0 + 1e-6  # at most min(N, D)


def test_alignment_is_the_mean_powered_distance_of_normalised_pairs():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    for alpha in (2.0, 1.0):
        expected = sum(
            math.sqrt(sum((a - b) ** 2 for a, b in zip(unit(x[i]), unit(y[i])))) ** alpha for i in range(7)) / 7
        assert alignment(x, y, alpha) == pytest.approx(expected, rel=1e-9)
    assert alignment(x, 3 * x) == pytest.approx(0.0, abs=1e-10)  # scale does not matter on the sphere
    assert alignment(x, -x) == pytest.approx(4.0)  # antipodes: ||2u||^2
    with pytest.raises(ValueError, match="equal shapes"):
        alignment(x, y[:3])


def test_uniformity_is_the_log_mean_gaussian_potential_over_pairs():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    rows = [unit(r) for r in x]
    potentials = [math.exp(-2 * sum((a - b) ** 2 for a, b in zip(rows[i], rows[j])))
                  for i in range(6) for j in range(i + 1, 6)]
    assert uniformity(x) == pytest.approx(math.log(sum(potentials) / len(potentials)), rel=1e-9)
    assert uniformity(torch.ones(5, 3)) == pytest.approx(0.0, abs=1e-12)  # all in one point
    # Antipodal pairs are as far apart as the sphere allows: potential exp(-2 * 4).
    assert uniformity(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(-8.0)
    with pytest.raises(ValueError, match="at least 2"):
        uniformity(x[:1])


def test_modality_gap_is_the_distance_of_the_normalised_centroids():
    g = torch.Generator().manual_seed(4)
    image, text = torch.randn(9, 3, generator=g) + 2, torch.randn(5, 3, generator=g) - 2
    ci = [sum(unit(r)[k] for r in image) / 9 for k in range(3)]
    ct = [sum(unit(r)[k] for r in text) / 5 for k in range(3)]
    assert modality_gap(image, text) == pytest.approx(math.dist(ci, ct), rel=1e-9)
    assert modality_gap(image, 5 * image) == pytest.approx(0.0, abs=1e-6)  # float32 inputs
    assert modality_gap(torch.tensor([[1.0, 0.0]]), torch.tensor([[-1.0, 0.0]])) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="widths differ"):
        modality_gap(image, torch.randn(4, 2))
