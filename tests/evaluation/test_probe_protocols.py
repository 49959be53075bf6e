"""The suite's probe protocols and retrieval over cached features (mmssl.evaluation.protocols), in
process: CLIP's linear probe searches lambda on a held-out split of the training rows (or the given
validation split), on L2-normalised features, then fits on training and held-out rows together
(CLIP appendix A.3); CLIP_benchmark's and MAE's probes report their own settings; k-NN takes its
protocol's k and temperature; the held-out split; retrieval with captionless images, more than one
block of queries, and k's without 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmssl.evaluation import protocols
from mmssl.evaluation.knn import knn_scores


def _clusters(n: int, seed: int, classes: int = 3, dim: int = 6,
              noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows near one of ``classes`` orthogonal directions, at varied norms: linearly separable at the
    default ``noise``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    x = torch.eye(dim)[labels] * 3 + noise * torch.randn(n, dim, generator=g)
    return x * torch.rand(n, 1, generator=g).add(0.5), labels


def _fits(monkeypatch, calls: list | None = None) -> list[int]:
    """The number of rows of every ``fit_linear`` call of the probe (and in ``calls``, each call's
    classes, method and keyword arguments)."""
    rows, fit = [], protocols.fit_linear

    def spy(x, y, classes, method="lbfgs", **kwargs):
        rows.append(int(x.shape[0]))
        if calls is not None:
            calls.append((classes, method, kwargs))
        return fit(x, y, classes, method, **kwargs)

    monkeypatch.setattr(protocols, "fit_linear", spy)
    return rows


def test_clips_probe_searches_on_a_held_out_fifth_then_fits_on_all_training_rows(monkeypatch):
    train, train_y = _clusters(30, 0)
    test, test_y = _clusters(15, 1)
    calls: list = []
    rows = _fits(monkeypatch, calls)
    figures, settings = protocols.linear_probe(train, train_y, test, test_y, 3, "clip", {"max_iter": 50}, seed=0)
    # Every fit: 3 classes, L-BFGS at the protocol's iterations and scikit-learn's tolerance; the
    # final one at the chosen lambda over all its rows.
    assert all(c[:2] == (3, "lbfgs") and c[2]["max_iter"] == 50 and c[2]["tolerance_grad"] == 1e-4 for c in calls)
    assert calls[-1][2]["weight_decay"] == pytest.approx(settings["lambda"] / 30)
    assert set(figures) == {"lp_acc1", "lp_mean_per_class_recall"}  # 3 classes: no top-5
    assert figures["lp_acc1"].point() == 1.0 and figures["lp_mean_per_class_recall"].point() == 1.0
    assert settings["num_val"] == 6 and settings["normalized"] is True
    assert settings["lambda"] in protocols.CLIP_LAMBDAS
    assert settings["weight_decay"] == pytest.approx(settings["lambda"] / 30)  # lambda over all 30 rows
    assert 7 <= settings["lambdas_tried"] == len(rows) - 1 <= 7 + 2 * 4 and settings["val_acc1"] == 1.0
    assert set(rows[:-1]) == {24} and rows[-1] == 30  # the search on 24 rows, the final fit on 30
    # A given validation split is held out instead, and joins the final fit.
    rows.clear()
    val, val_y = _clusters(9, 2)
    _, settings = protocols.linear_probe(train, train_y, test, test_y, 3, "clip", {"max_iter": 50}, seed=0,
                                         val=(val, val_y))
    assert settings["num_val"] == 9 and set(rows[:-1]) == {30} and rows[-1] == 39
    assert settings["weight_decay"] == pytest.approx(settings["lambda"] / 39)
    # Without max_iter: CLIP's 1000 (appendix A.3), for the search and the final fit.
    calls.clear()
    protocols.linear_probe(train, train_y, test, test_y, 3, "clip", {}, seed=0)
    assert {c[2]["max_iter"] for c in calls} == {1000}


def test_clips_probe_reads_directions_only():
    """Features are L2-normalised first: rescaling rows (train, val and test) changes nothing, on
    overlapping classes where the search's choice and the test predictions depend on the features."""
    train, train_y = _clusters(24, 3, noise=2.0)
    test, test_y = _clusters(12, 4, noise=2.0)
    g = torch.Generator().manual_seed(5)
    scale = lambda x: x * torch.rand(x.shape[0], 1, generator=g).mul(100).add(0.01)  # noqa: E731
    opts = {"max_iter": 30, "val_fraction": 0.25}
    a, sa = protocols.linear_probe(train, train_y, test, test_y, 3, "clip", opts, seed=1)
    b, sb = protocols.linear_probe(scale(train), train_y, scale(test), test_y, 3, "clip", opts, seed=1)
    assert sa["lambda"] == sb["lambda"] and sa["num_val"] == sb["num_val"] == 6
    assert torch.equal(a["lp_acc1"].numerator, b["lp_acc1"].numerator)
    assert 0 < a["lp_acc1"].point() < 1 and 0 < sa["val_acc1"] < 1
    val, val_y = _clusters(6, 6, noise=2.0)
    c, sc = protocols.linear_probe(train, train_y, test, test_y, 3, "clip", opts, seed=1, val=(val, val_y))
    d, sd = protocols.linear_probe(train, train_y, test, test_y, 3, "clip", opts, seed=1, val=(scale(val), val_y))
    assert sc["lambda"] == sd["lambda"] and sc["val_acc1"] == sd["val_acc1"]
    assert torch.equal(c["lp_acc1"].numerator, d["lp_acc1"].numerator)


def test_clip_benchmarks_probe_reports_its_search_and_recipe(monkeypatch):
    train, train_y = _clusters(20, 7)
    test, test_y = _clusters(10, 8)
    recipe = {"epochs": 2, "lr": 0.1, "batch_size": 8}
    calls, fit = [], protocols.fit_adamw_cosine

    def spy(x, y, classes, wd, **kwargs):
        calls.append((int(x.shape[0]), kwargs))
        return fit(x, y, classes, wd, **kwargs)

    monkeypatch.setattr(protocols, "fit_adamw_cosine", spy)
    figures, settings = protocols.linear_probe(train, train_y, test, test_y, 3, "clip_benchmark",
                                               {"clip_benchmark": recipe}, seed=4)
    assert set(figures) == {"lp_acc1", "lp_mean_per_class_recall"}
    assert settings["weight_decay"] in protocols.CB_WEIGHT_DECAYS and settings["num_val"] == 4
    assert 7 <= settings["weight_decays_tried"] <= 15 and 0 <= settings["val_acc1"] <= 1
    assert settings["normalized"] is True and settings["clip_benchmark"] == {"seed": 4, **recipe}
    # Every fit, the final one on all 20 rows included, follows the recipe from the protocol's seed.
    assert calls[-1][0] == 20 and {r for r, _ in calls[:-1]} == {16}
    assert all(kwargs == {"seed": 4, **recipe} for _, kwargs in calls)


def test_maes_probe_fits_the_raw_features_with_its_recipe():
    train, train_y = _clusters(40, 9, classes=5, dim=8)
    test, test_y = _clusters(20, 10, classes=5, dim=8)
    recipe = {"epochs": 30, "optimizer": "sgd", "batch_size": 8, "warmup_epochs": 1}
    figures, settings = protocols.linear_probe(train, train_y, test, test_y, 5, "mae", {"mae": recipe}, seed=3)
    assert set(figures) == {"lp_acc1", "lp_acc5", "lp_mean_per_class_recall"}  # 5 classes: top-5 too
    assert settings == {"mae": {"seed": 3, **recipe}}
    assert figures["lp_acc5"].point() == 1.0 and figures["lp_acc1"].point() >= 0.9


@pytest.mark.parametrize("protocol, k, temperature", [("lightly", 200, 0.1), ("dino", 20, 0.07)])
def test_knn_takes_its_protocols_k_and_temperature(protocol, k, temperature):
    train, train_y = _clusters(250, 11, classes=6, dim=8)
    test, test_y = _clusters(30, 12, classes=6, dim=8)
    figures, settings = protocols.knn(train, train_y, test, test_y, 6, protocol)
    assert settings == {"k": k, "temperature": temperature}
    scores = knn_scores(train, train_y, test, 6, k, temperature)
    assert torch.equal(figures["acc1"].numerator, (scores.argmax(dim=1) == test_y).float())
    assert set(figures) == {"acc1", "acc5", "mean_per_class_recall"}


@pytest.mark.parametrize("n, fraction, held", [(10, 0.2, 2), (3, 0.01, 1), (2, 0.9, 1), (7, 0.5, 4)])
def test_the_held_out_split_is_a_seeded_partition_with_at_least_one_row_each_side(n, fraction, held):
    fit, val = protocols.held_out_split(n, fraction, seed=5)
    assert len(val) == held and len(fit) == n - held
    assert sorted(torch.cat([fit, val]).tolist()) == list(range(n))
    again = protocols.held_out_split(n, fraction, seed=5)
    assert torch.equal(again[1], val)
    assert not all(torch.equal(protocols.held_out_split(10, 0.5, s)[1], protocols.held_out_split(10, 0.5, 5)[1])
                   for s in range(6, 10))


def _brute(image, text, owner, k):
    """CLIP_benchmark's recalls by sorting every score (lower index first on ties)."""
    n = image.shape[0]
    i2t = [(owner[(image[i] @ text.T).argsort(descending=True, stable=True)[:k]] == i).any().item()
           for i in range(n) if (owner == i).any()]
    t2i = [(owner[j] in (text[j] @ image.T).argsort(descending=True, stable=True)[:k].tolist())
           for j in range(text.shape[0])]
    return sum(t2i) / len(t2i), sum(i2t) / len(i2t)


def test_retrieval_over_more_than_one_block_with_captionless_images():
    g = torch.Generator().manual_seed(13)
    n = 1100  # more than one block of 1024 queries each way
    image = F.normalize(torch.randn(n, 8, generator=g), dim=1)
    owner = torch.cat([torch.arange(0, n, 2), torch.arange(0, 1000, 2)])  # odd images: no caption; some two
    assert len(owner) > 1024  # more than one block of caption queries too
    text = F.normalize(image[owner] + 0.5 * torch.randn(len(owner), 8, generator=g), dim=1)
    figures = protocols.retrieval(image, text, owner, [5])
    assert set(figures) == {"image_retrieval_recall@5", "text_retrieval_recall@5", "mean_recall@1"}  # k = 1 inside
    image_r5, text_r5 = _brute(image, text, owner, 5)
    image_r1, text_r1 = _brute(image, text, owner, 1)
    assert figures["image_retrieval_recall@5"].point() == pytest.approx(image_r5)
    assert figures["text_retrieval_recall@5"].point() == pytest.approx(text_r5)
    assert figures["mean_recall@1"].point() == pytest.approx((image_r1 + text_r1) / 2)
    assert 0 < image_r1 < image_r5 < 1 and 0 < text_r1 < text_r5 < 1


def test_the_knn_protocols_temperature_decides_between_one_close_and_several_farther_neighbours():
    """One class-0 neighbour at cosine 0.99 against three class-1 neighbours at 0.9: at lightly's
    T = 0.1, e^9.9 < 3 e^9 (class 1); at DINO's T = 0.07, e^14.1 > 3 e^12.9 (class 0)."""
    unit = lambda c: [c, (1 - c * c) ** 0.5, 0.0]  # noqa: E731
    train = torch.tensor([unit(0.99), unit(0.9), unit(0.9), unit(0.9), [-1.0, 0, 0], [-1.0, 0, 0]])
    labels = torch.tensor([0, 1, 1, 1, 2, 2])
    query, truth = torch.tensor([[1.0, 0, 0]]), torch.tensor([0])
    lightly, _ = protocols.knn(train, labels, query, truth, 3, "lightly")
    dino, _ = protocols.knn(train, labels, query, truth, 3, "dino")
    assert lightly["acc1"].point() == 0.0 and dino["acc1"].point() == 1.0


def test_the_parametric_search_starts_from_every_16th_point_and_finds_any_single_peak():
    """CLIP A.3: 7 starting points (10^-6, 10^-4, ..., 10^6), then halving spans of 8, 4, 2, 1
    around the best: every one of the 97 points is reachable, on any grid size."""
    for peak in range(97):
        tried: list[int] = []

        def score(i: int) -> float:
            assert 0 <= i < 97, i  # never off the grid
            tried.append(i)
            return -abs(i - peak)

        assert protocols.parametric_search(score) == peak
        assert sorted(list(dict.fromkeys(tried))[:7]) == [0, 16, 32, 48, 64, 80, 96]  # scored first
    for size, peak in ((50, 49), (50, 0), (20, 19)):  # the last point is not a starting point
        assert protocols.parametric_search(lambda i: -abs(i - peak), size=size) == peak
