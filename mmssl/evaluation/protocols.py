"""The suite's protocols over cached features: each returns per-unit figures (``bootstrap.Figure``)
named with CLIP_benchmark's metric keys, and the protocol's own settings.

- zero-shot (``zeroshot_classification``): ``acc1``, ``acc5``, ``mean_per_class_recall``;
- linear probe: ``lp_acc1``, ``lp_acc5``, ``lp_mean_per_class_recall`` (CLIP_benchmark's
  ``linear_probe`` keys); protocol ``clip`` (CLIP appendix A.3), ``mae`` (MAE appendix A.1) or
  ``clip_benchmark`` (CLIP_benchmark 1.6.2's AdamW recipe, to compare with its figures);
- k-NN: ``acc1``, ``acc5``, ``mean_per_class_recall``; protocol ``lightly`` or ``dino``;
- retrieval (``zeroshot_retrieval``): ``image_retrieval_recall@k``, ``text_retrieval_recall@k``
  and ``mean_recall@1`` (their mean at k = 1, DataComp's retrieval score).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mmssl.evaluation.bootstrap import ClassRecall, Figure, MeanOf, Ratio
from mmssl.evaluation.knn import knn_scores
from mmssl.evaluation.linear import fit_adamw_cosine, fit_linear, fit_mae_linear
from mmssl.retrieval import places

# CLIP appendix A.3: "the L2 regularization strength lambda ... between 10^-6 and 10^6, with 96
# logarithmically spaced steps", searched from [10^-6, 10^-4, ..., 10^6] by halving the interval
# around the peak "until it reaches a resolution of 8 steps per decade".
CLIP_LAMBDAS: tuple[float, ...] = tuple(float(x) for x in torch.logspace(-6, 6, 97, dtype=torch.float64))
CLIP_START_STEP = 16  # the search starts from every 16th lambda: 10^-6, 10^-4, ..., 10^6
CLIP_MAX_ITER = 1000  # appendix A.3: scikit-learn's L-BFGS, "max 1000 iterations"
CLIP_TOLERANCE = 1e-4  # scikit-learn LogisticRegression's default tol (its lbfgs gradient bound)
# CLIP_benchmark 1.6.2 (linear_probe.evaluate): "instead of scikit-learn LBFGS use FCNNs with
# AdamW", weight decay from np.logspace(-6, 2, num=97), the same search from every 16th point.
CB_WEIGHT_DECAYS: tuple[float, ...] = tuple(float(x) for x in torch.logspace(-6, 2, 97, dtype=torch.float64))
KNN: dict[str, dict[str, float]] = {
    "lightly": {"k": 200, "temperature": 0.1},  # lightly.utils.benchmarking.knn_predict defaults
    "dino": {"k": 20, "temperature": 0.07},  # DINO eval_knn.py (--nb_knn 20, --temperature 0.07)
}


def classification_figures(logits: Tensor, labels: Tensor, num_classes: int, prefix: str = "") -> dict[str, Figure]:
    """Top-1, top-5 (when C >= 5, as CLIP_benchmark) and mean per-class recall of (N, C) logits."""
    ones = torch.ones(labels.shape[0])
    top1 = (logits.argmax(dim=1) == labels).float()
    figures: dict[str, Figure] = {f"{prefix}acc1": Ratio(top1, ones)}
    if num_classes >= 5:
        top5 = (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1).float()
        figures[f"{prefix}acc5"] = Ratio(top5, ones)
    figures[f"{prefix}mean_per_class_recall"] = ClassRecall(top1, labels, num_classes)
    return figures


def zero_shot(features: Tensor, labels: Tensor, classifier: Tensor) -> dict[str, Figure]:
    """Zero-shot figures of (N, D) image embeddings against a (D, C) text classifier."""
    logits = F.normalize(features.float(), dim=-1) @ classifier.float()  # (N, C)
    return classification_figures(logits, labels, classifier.shape[1])


def knn(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor, num_classes: int,
        protocol: str) -> tuple[dict[str, Figure], dict[str, Any]]:
    """Weighted k-NN figures with the protocol's k and temperature."""
    settings = KNN[protocol]
    scores = knn_scores(train, train_labels, test, num_classes, int(settings["k"]), settings["temperature"])
    return classification_figures(scores, test_labels, num_classes), dict(settings)


def _accuracy(model: torch.nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def parametric_search(score: Callable[[int], float], size: int = len(CLIP_LAMBDAS), start_step: int = 16) -> int:
    """CLIP appendix A.3's parametric binary search over a grid of ``size`` points.

    The best of every ``start_step``-th point (7 of the 97 lambdas: 10^-6, 10^-4, ..., 10^6) is
    the peak; then, with a span of 8, 4, 2, 1 grid steps, the best of the peak's left neighbour,
    the peak and its right neighbour at that span. Ties keep the first in that order, as
    CLIP_benchmark's ``find_peak``; each point is scored at most once by the caller's cache.

    Args:
        score: grid index -> held-out accuracy.
        size: grid points.
        start_step: spacing of the starting points.

    Returns:
        The index of the chosen point.
    """
    def best(candidates: Sequence[int]) -> int:
        top = candidates[0]
        for i in candidates[1:]:
            if score(i) > score(top):
                top = i
        return top

    peak = best(list(range(0, size, start_step)))
    span = start_step // 2
    while span > 0:
        peak = best([max(peak - span, 0), peak, min(peak + span, size - 1)])
        span //= 2
    return peak


def clip_lambda_search(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor, num_classes: int,
                       max_iter: int = CLIP_MAX_ITER) -> tuple[float, dict[float, float]]:
    """The L2 strength of CLIP's linear probe, by :func:`parametric_search` on a held-out split.

    lambda is scikit-learn's ``1 / C`` (summed loss + lambda/2 ||W||^2), i.e. ``weight_decay =
    lambda / N`` of :func:`mmssl.evaluation.linear.fit_logistic`'s mean loss.

    Each fit starts from the optimum of the nearest lambda fitted so far, and the search's seven
    starting points are fitted from the strongest down (a regularisation path, as glmnet and
    scikit-learn's ``warm_start``): a weak lambda on near-separable features takes L-BFGS hundreds
    of iterations from zeros and a few dozen from its stronger neighbour. The objective is
    strictly convex, so the start changes the optimum found only within the tolerance; the
    lambdas scored and chosen are the search's own.

    Returns:
        The chosen lambda and the held-out accuracy of every lambda tried.
    """
    scores: dict[int, float] = {}
    heads: dict[int, torch.nn.Linear] = {}

    def score(i: int) -> float:
        if i not in scores:
            start = heads[min(heads, key=lambda j: abs(j - i))] if heads else None
            fit = fit_linear(train, train_labels, num_classes, "lbfgs",
                             weight_decay=CLIP_LAMBDAS[i] / train.shape[0], max_iter=max_iter,
                             tolerance_grad=CLIP_TOLERANCE, init=start)
            heads[i] = fit[1]
            scores[i] = _accuracy(fit, val, val_labels)
        return scores[i]

    for i in reversed(range(0, len(CLIP_LAMBDAS), CLIP_START_STEP)):
        score(i)
    peak = parametric_search(score, start_step=CLIP_START_STEP)
    return CLIP_LAMBDAS[peak], {CLIP_LAMBDAS[i]: s for i, s in sorted(scores.items())}


# Below this many multiply-adds per loss evaluation (N x D x C) the probe's L-BFGS runs on one
# thread: at 2000 x 128 x 36 one evaluation took 1.0 ms of CPU on one thread and 5.4 ms on two
# (2 shared cores), the second thread's synchronisation costing more than it computes.
SINGLE_THREAD_FLOPS = 10**8


@contextlib.contextmanager
def small_problem_threads(rows: int, dim: int, num_classes: int) -> Iterator[None]:
    """Inside: one intra-op thread when the fit is below :data:`SINGLE_THREAD_FLOPS`."""
    threads = torch.get_num_threads()
    if rows * dim * num_classes < SINGLE_THREAD_FLOPS:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def clip_benchmark_search(train: Tensor, train_labels: Tensor, val: Tensor, val_labels: Tensor, num_classes: int,
                          fit: dict[str, Any]) -> tuple[float, dict[float, float]]:
    """CLIP_benchmark's weight decay: :func:`parametric_search` over :data:`CB_WEIGHT_DECAYS`, each
    point a :func:`fit_adamw_cosine` from its seed (as its ``find_peak``; no warm start).

    Returns:
        The chosen weight decay and the held-out accuracy of every one tried.
    """
    scores: dict[int, float] = {}

    def score(i: int) -> float:
        if i not in scores:
            head = fit_adamw_cosine(train, train_labels, num_classes, CB_WEIGHT_DECAYS[i], **fit)
            scores[i] = _accuracy(head, val, val_labels)
        return scores[i]

    peak = parametric_search(score, size=len(CB_WEIGHT_DECAYS), start_step=16)
    return CB_WEIGHT_DECAYS[peak], {CB_WEIGHT_DECAYS[i]: s for i, s in sorted(scores.items())}


def held_out_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random split of n training rows: (fit rows, held-out rows), the held-out part at least one row."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(n - 1, max(1, round(n * fraction)))
    return order[n_val:], order[:n_val]


def linear_probe(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor, num_classes: int,
                 protocol: str, options: dict[str, Any], seed: int,
                 val: tuple[Tensor, Tensor] | None = None) -> tuple[dict[str, Figure], dict[str, Any]]:
    """A linear probe by the protocol, scored on the test features.

    ``clip``: L2-normalised features (as CLIP_benchmark's ``normalize``), lambda by
    :func:`clip_lambda_search` on ``val`` (else a held-out ``val_fraction`` of the training
    rows), then the final fit on training and held-out rows together (CLIP A.3: "we combine the
    validation split back with the training split"). ``clip_benchmark``: the same split and
    features, CLIP_benchmark's AdamW fit (:func:`fit_adamw_cosine`; ``options["clip_benchmark"]``:
    ``lr``, ``epochs``, ``batch_size``) and weight-decay search (:func:`clip_benchmark_search`),
    the final fit on training and held-out rows. ``mae``: :func:`fit_mae_linear` on the raw
    features with ``options["mae"]`` (the paper's recipe by default).

    Returns:
        ``lp_*`` figures and the protocol's settings (``lambda``, ``weight_decay``, ...).
    """
    if protocol == "mae":
        kwargs = {"seed": seed, **(options.get("mae") or {})}
        with torch.inference_mode(False), torch.enable_grad():
            head = fit_mae_linear(train.clone(), train_labels.clone(), num_classes, **kwargs)
        with torch.no_grad():
            logits = head(test)
        return classification_figures(logits, test_labels, num_classes, "lp_"), {"mae": kwargs}
    train, test = F.normalize(train.float(), dim=-1), F.normalize(test.float(), dim=-1)
    if val is None:
        fit_rows, val_rows = held_out_split(train.shape[0], float(options.get("val_fraction", 0.2)), seed)
        fit_x, fit_y, val_x, val_y = train[fit_rows], train_labels[fit_rows], train[val_rows], train_labels[val_rows]
    else:
        fit_x, fit_y, val_x, val_y = train, train_labels, F.normalize(val[0].float(), dim=-1), val[1]
    all_x, all_y = torch.cat([fit_x, val_x]), torch.cat([fit_y, val_y])
    if protocol == "clip_benchmark":
        fit = {"seed": seed, **(options.get("clip_benchmark") or {})}
        with small_problem_threads(all_x.shape[0], all_x.shape[1], num_classes):
            wd, tried = clip_benchmark_search(fit_x, fit_y, val_x, val_y, num_classes, fit)
            head = fit_adamw_cosine(all_x, all_y, num_classes, wd, **fit)
        with torch.no_grad():
            logits = head(test)
        settings = {"weight_decay": wd, "num_val": int(val_x.shape[0]), "weight_decays_tried": len(tried),
                    "val_acc1": max(tried.values()), "normalized": True, "clip_benchmark": fit}
        return classification_figures(logits, test_labels, num_classes, "lp_"), settings
    max_iter = int(options.get("max_iter", CLIP_MAX_ITER))
    with small_problem_threads(all_x.shape[0], all_x.shape[1], num_classes):
        lam, tried = clip_lambda_search(fit_x, fit_y, val_x, val_y, num_classes, max_iter)
        head = fit_linear(all_x, all_y, num_classes, "lbfgs", weight_decay=lam / all_x.shape[0],
                          max_iter=max_iter, tolerance_grad=CLIP_TOLERANCE)
    with torch.no_grad():
        logits = head(test)
    settings = {"lambda": lam, "weight_decay": lam / all_x.shape[0], "num_val": int(val_x.shape[0]),
                "lambdas_tried": len(tried), "val_acc1": max(tried.values()), "normalized": True}
    return classification_figures(logits, test_labels, num_classes, "lp_"), settings


def retrieval(image: Tensor, text: Tensor, text_image: Tensor, recall_k: Sequence[int]) -> dict[str, Figure]:
    """Image-text retrieval recall@k, units the images (each with its captions).

    As CLIP_benchmark's ``zeroshot_retrieval``: ``image_retrieval_recall@k`` is, per caption,
    whether its image is among the k images most similar to it; ``text_retrieval_recall@k`` is,
    per image, whether any of its captions is among the k most similar captions. Ties (repeated
    captions or images) follow :mod:`mmssl.retrieval`'s convention, as training validation does:
    another image's identical caption is a negative, and equal scores rank the lower index first.

    Args:
        image: (N, D) L2-normalised image embeddings.
        text: (M, D) L2-normalised caption embeddings.
        text_image: (M,) the image of each caption.
        recall_k: the k's (k = 1 is always scored, for ``mean_recall@1``).

    Returns:
        The figures, each over the N images.
    """
    ks = sorted(set(recall_k) | {1})
    n = image.shape[0]
    image_hits = torch.zeros(len(ks), n)  # per image: hits among its captions (image retrieval)
    text_hits = torch.zeros(len(ks), n)  # per image: 1 if a caption of it is in its top k
    captions = torch.bincount(text_image, minlength=n).float()  # (N,)
    block = 1024
    for start in range(0, text.shape[0], block):  # caption queries -> images
        scores = text[start:start + block].float() @ image.float().T  # (b, N)
        target = text_image[start:start + block]
        rank = places(scores, target)  # (b,) 0 = first
        for i, k in enumerate(ks):
            image_hits[i].index_add_(0, target, (rank < k).float())
    for start in range(0, n, block):  # image queries -> captions
        scores = image[start:start + block].float() @ text.float().T  # (b, M)
        own = text_image[None, :] == torch.arange(start, min(start + block, n))[:, None]  # (b, M)
        best = scores.masked_fill(~own, -math.inf).argmax(dim=1)  # (b,) the best own caption, first on ties
        rank = places(scores, best)
        for i, k in enumerate(ks):
            text_hits[i, start:start + block] = (rank < k).float()
    has_caption = (captions > 0).float()
    figures: dict[str, Figure] = {}
    for i, k in enumerate(ks):
        if k in recall_k:
            figures[f"image_retrieval_recall@{k}"] = Ratio(image_hits[i], captions)
            figures[f"text_retrieval_recall@{k}"] = Ratio(text_hits[i] * has_caption, has_caption)
    figures["mean_recall@1"] = MeanOf([Ratio(image_hits[0], captions), Ratio(text_hits[0] * has_caption, has_caption)])
    return figures
