"""The CLIP linear probe's lambda search: a warm-started regularisation path (strongest lambda
first, each fit from its nearest fitted neighbour) that picks what a cold search picks, and its
single-threaded fits on small problems; and CLIP_benchmark's AdamW probe (protocol
``clip_benchmark``)."""

from __future__ import annotations

import math

import pytest
import torch

from mmssl.evaluation import linear, protocols


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.randn(3, 6, generator=g)
    return centres[labels] + 1.5 * torch.randn(n, 6, generator=g), labels


def test_search_is_a_warm_started_path_from_the_strongest_lambda(monkeypatch):
    fits: list[tuple[float, bool]] = []
    fit = protocols.fit_linear

    def recording(x, y, c, method, **kwargs):
        fits.append((kwargs["weight_decay"] * x.shape[0], kwargs.get("init") is not None))
        return fit(x, y, c, method, **kwargs)

    monkeypatch.setattr(protocols, "fit_linear", recording)
    (x, y), (vx, vy) = _blobs(60, 0), _blobs(30, 1)
    protocols.clip_lambda_search(x, y, vx, vy, 3, max_iter=50)
    starts = [lam for lam, _ in fits[:7]]
    assert starts == pytest.approx([protocols.CLIP_LAMBDAS[i] for i in range(96, -1, -16)])
    assert not fits[0][1] and all(warm for _, warm in fits[1:])  # only the first fit starts from zeros


def test_warm_search_chooses_what_a_cold_one_does(monkeypatch):
    (x, y), (vx, vy) = _blobs(90, 2), _blobs(60, 3)
    warm = protocols.clip_lambda_search(x, y, vx, vy, 3)
    fit = protocols.fit_linear
    monkeypatch.setattr(protocols, "fit_linear", lambda *a, init=None, **k: fit(*a, **k))  # every fit from zeros
    cold = protocols.clip_lambda_search(x, y, vx, vy, 3)
    assert warm[0] == cold[0]
    assert warm[1] == pytest.approx(cold[1], abs=1 / 60)  # at most one held-out image moves


def test_fit_logistic_starts_from_init():
    x, y = _blobs(60, 4)
    head = linear.fit_logistic(x, y, 3, weight_decay=1e-2, max_iter=200, tolerance_grad=1e-6)
    again = linear.fit_logistic(x, y, 3, weight_decay=1e-2, max_iter=1, tolerance_grad=1e-6, init=head[1])
    assert torch.allclose(again[1].weight, head[1].weight, atol=1e-4)  # from the optimum: stays there


def test_small_problems_run_on_one_thread_and_restore_the_setting():
    before = torch.get_num_threads()  # the suite's conftest runs tests on one thread: start from two
    torch.set_num_threads(2)
    try:
        with protocols.small_problem_threads(100, 10, 3):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with protocols.small_problem_threads(10**6, 1000, 1000):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_clip_benchmark_probe_searches_its_grid_and_leaves_the_callers_rng(monkeypatch):
    tried: list[float] = []
    fit = protocols.fit_adamw_cosine

    def recording(x, y, c, wd, **kwargs):
        tried.append(wd)
        return fit(x, y, c, wd, **kwargs)

    monkeypatch.setattr(protocols, "fit_adamw_cosine", recording)
    blobs, labels = _blobs(150, 5)  # one draw of centres: training, held-out and test rows from it
    (x, y), (vx, vy), (tx, ty) = ((blobs[a:b], labels[a:b]) for a, b in ((0, 60), (60, 90), (90, 150)))
    state = torch.get_rng_state()
    figures, settings = protocols.linear_probe(x, y, tx, ty, 3, "clip_benchmark", {"clip_benchmark": {"epochs": 2}},
                                               seed=0, val=(vx, vy))
    assert torch.equal(torch.get_rng_state(), state)  # fork_rng: training's data order is untouched
    # CLIP_benchmark's starting points (np.logspace(-6, 2, 7): every 16th of 97), then 4 rounds of
    # 2 new neighbours at most, then the final fit at the chosen weight decay
    assert sorted(tried[:7]) == pytest.approx([10 ** (-6 + 8 * i / 6) for i in range(7)])
    assert settings["weight_decay"] == tried[-1] and settings["weight_decay"] in protocols.CB_WEIGHT_DECAYS
    assert len(tried) == settings["weight_decays_tried"] + 1 <= 7 + 8 + 1
    assert figures["lp_acc1"].point() > 0.6  # three separable blobs
    again, _ = protocols.linear_probe(x, y, tx, ty, 3, "clip_benchmark", {"clip_benchmark": {"epochs": 2}},
                                      seed=0, val=(vx, vy))
    assert again["lp_acc1"].point() == figures["lp_acc1"].point()


def test_clip_benchmark_fit_follows_its_cosine_schedule_from_its_seeded_init(monkeypatch):
    lrs: list[float] = []
    step = torch.optim.AdamW.step

    def recording(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    x, y = _blobs(10, 8)
    head = linear.fit_adamw_cosine(x, y, 3, 1e-4, lr=0.1, epochs=2, batch_size=4)  # 3 batches x 2 epochs
    assert lrs == pytest.approx([0.05 * (1 + math.cos(math.pi * s / 6)) for s in range(6)])
    torch.manual_seed(0)
    init = torch.nn.Linear(6, 3)  # what CLIP_benchmark's train() starts from at --seed 0
    assert not torch.equal(head.weight, init.weight)
    zero_steps = linear.fit_adamw_cosine(x, y, 3, 1e-4, epochs=0)
    assert torch.equal(zero_steps.weight, init.weight) and torch.equal(zero_steps.bias, init.bias)
