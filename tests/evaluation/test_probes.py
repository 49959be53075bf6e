"""Pure probe functions: linear fits, k-NN, frozen evaluation state, the depth plot."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmssl.evaluation.features import FeatureSet, frozen_eval, gather_feature_set
from mmssl.evaluation.knn import knn_scores
from mmssl.evaluation.linear import fit_linear, topk_accuracy
from mmssl.evaluation.plot import plot_layer_accuracy


def _clusters(n: int, classes: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around well-separated class means: linearly separable with high margin."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=torch.Generator().manual_seed(123)) * 4
    labels = torch.arange(n) % classes
    return means[labels] + 0.5 * torch.randn(n, dim, generator=g), labels


MAE_SMALL = {"epochs": 20, "batch_size": 64, "warmup_epochs": 2}


# LARS scales each step by 0.001 * |w| / |g|: the paper's blr 0.1 presumes batch 16384 and ~7000
# steps; 140 small steps need a larger base rate.
@pytest.mark.parametrize("method,kwargs", [
    ("lbfgs", {}),
    ("mae", {**MAE_SMALL, "optimizer": "sgd"}),
    ("mae", {**MAE_SMALL, "optimizer": "lars", "blr": 20.0}),
])
def test_probe_separates_separable_features(method, kwargs):
    x, y = _clusters(400, 5, 16, seed=0)
    xv, yv = _clusters(200, 5, 16, seed=1)
    probe = fit_linear(x, y, 5, method, **kwargs)
    assert topk_accuracy(probe(xv), yv)["top1"] >= 0.98


def test_probe_is_at_chance_on_shuffled_labels():
    g = torch.Generator().manual_seed(0)
    x, xv = torch.randn(600, 16, generator=g), torch.randn(2000, 16, generator=g)
    y, yv = torch.randint(0, 4, (600,), generator=g), torch.randint(0, 4, (2000,), generator=g)
    probe = fit_linear(x, y, 4, "lbfgs")
    assert topk_accuracy(probe(x), y)["top1"] > 0.3  # it does fit the training noise a little
    assert abs(topk_accuracy(probe(xv), yv)["top1"] - 0.25) < 0.05  # but learns nothing general


def test_lbfgs_probe_is_deterministic_and_leaves_global_rng_alone():
    x, y = _clusters(100, 3, 8, seed=0)
    state = torch.get_rng_state()
    a, b = fit_linear(x, y, 3, "lbfgs"), fit_linear(x, y, 3, "mae", epochs=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a(x), fit_linear(x, y, 3, "lbfgs")(x)) and b(x).shape == (100, 3)


def test_probe_rejects_labels_outside_classes():
    with pytest.raises(ValueError, match="labels must lie"):
        fit_linear(torch.randn(4, 2), torch.tensor([0, 1, 2, 3]), 3)


def test_knn_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    bank, labels = torch.randn(50, 8, generator=g), torch.randint(0, 4, (50,), generator=g)
    queries = torch.randn(7, 8, generator=g)
    k, t = 5, 0.07
    scores = knn_scores(bank, labels, queries, 4, k=k, temperature=t, chunk_size=3)
    for q in range(7):
        sims = [float(F.cosine_similarity(queries[q], bank[i], dim=0)) for i in range(50)]
        expected = torch.zeros(4)
        for i in sorted(range(50), key=lambda i: -sims[i])[:k]:
            expected[labels[i]] += np.exp(sims[i] / t)
        torch.testing.assert_close(scores[q], expected, rtol=1e-4, atol=1e-4)


def test_frozen_eval_restores_modes_grads_and_rng():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.Linear(2, 2))
    model.train()
    model[2].eval()  # a submodule deliberately in eval stays so
    model[0].weight.requires_grad_(False)
    state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    with frozen_eval(model):
        assert not model.training and not torch.is_grad_enabled()
        torch.rand(3), random.random(), np.random.rand()
        model[2].weight.requires_grad_(False)
    assert model.training and model[1].training and not model[2].training
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert torch.equal(torch.get_rng_state(), state) and random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state[1])


def test_gather_at_world_size_one_is_identity():
    local = FeatureSet([torch.randn(3, 2)], torch.tensor([0, 1, 0]))
    assert gather_feature_set(local, lambda t: 1 / 0, 1) is local


def test_layer_plot_writes_png(tmp_path):
    path = tmp_path / "layers.png"
    image = plot_layer_accuracy({"linear top-1": [0.1, 0.5, 0.9]}, path=str(path))
    assert image.shape == (400, 640, 3) and image.dtype == np.uint8
    assert Image.open(path).size == (640, 400)
    assert (image != 255).any(axis=2).sum() > 1000  # something was drawn
