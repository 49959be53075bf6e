"""Linear classifiers on frozen features: a fast exact fit and the MAE paper's recipe.

Both are pure functions of (features, labels) tensors returning an ``nn.Module`` that maps
(N, D) features to (N, C) logits, so callbacks and tools share them and tests call them directly.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from timm.optim import Lars
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.functional.classification import multiclass_accuracy

from mmssl.evaluation.features import FeatureSet

Method = Literal["lbfgs", "mae"]
METHODS: tuple[str, ...] = ("lbfgs", "mae")


class Standardize(nn.Module):
    """(x - mean) / std with statistics frozen from the training features."""

    def __init__(self, mean: Tensor, std: Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


def _check(features: Tensor, labels: Tensor, num_classes: int) -> None:
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError(
            f"expected features (N, D) and labels (N,), got {tuple(features.shape)}, {tuple(labels.shape)}"
        )
    if features.shape[0] == 0:
        raise ValueError("no training features to fit a probe on (empty labelled train set?)")
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")


def fit_logistic(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    weight_decay: float = 1e-4,
    max_iter: int = 300,
    tolerance_grad: float = 1e-7,
    init: Optional[nn.Linear] = None,
) -> nn.Module:
    """Multinomial logistic regression by full-batch L-BFGS on standardised features.

    The objective (mean cross-entropy + ``weight_decay``/2 * ||W||^2) is strictly convex, so
    L-BFGS reaches its one optimum: the same answer every run, no learning rate or epochs to tune,
    and seconds on tens of thousands of cached features (the protocol of CLIP's linear-probe
    evaluation, sec. 3.2 / appendix A.3, which used scikit-learn's L-BFGS logistic regression).

    Args:
        features: (N, D) training features.
        labels: (N,) class indices.
        num_classes: C.
        weight_decay: L2 penalty on the weights (not the bias).
        max_iter: L-BFGS iterations.
        tolerance_grad: stop once every gradient entry is this small (scikit-learn's lbfgs
            ``tol`` is 1e-4 on the same mean-loss objective).
        init: start from this (D -> C) layer's weights instead of zeros (a warm start: a
            regularisation search fits neighbouring strengths, whose optima lie close together;
            the optimum itself does not depend on the start).

    Returns:
        A module (N, D) -> (N, C) logits, on the features' device.
    """
    _check(features, labels, num_classes)
    x = features.float()
    mean, std = x.mean(dim=0), x.std(dim=0, unbiased=False).clamp_min(1e-6)
    x = (x - mean) / std  # (N, D)
    # skip_init: no draw from the global RNG (training's masks and data order stay untouched)
    linear = nn.utils.skip_init(nn.Linear, x.shape[1], num_classes, device=x.device)
    with torch.no_grad():  # a deterministic start; the optimum does not depend on it
        if init is None:
            linear.weight.zero_()
            linear.bias.zero_()
        else:
            linear.weight.copy_(init.weight)
            linear.bias.copy_(init.bias)
    optimizer = torch.optim.LBFGS(
        linear.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
        tolerance_grad=tolerance_grad, tolerance_change=1e-10, line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(linear(x), labels) + 0.5 * weight_decay * linear.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return nn.Sequential(Standardize(mean, std), linear).eval()


def fit_mae_linear(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    epochs: int = 90,
    batch_size: int = 256,
    blr: float = 0.1,
    warmup_epochs: int = 10,
    optimizer: Literal["lars", "sgd"] = "lars",
    weight_decay: float = 0.0,
    seed: int = 0,
) -> nn.Module:
    """The MAE paper's linear probe (He et al. 2021, appendix A.1, Table 10; ``main_linprobe.py``).

    ``BatchNorm1d(affine=False, eps=1e-6)`` before the linear head (it normalises features whose
    scales differ wildly across layers and models, and, having no affine part, can be folded into
    the linear layer after training), head weights from trunc_normal(std=0.01), LARS with momentum
    0.9 and no weight decay, ``lr = blr * batch_size / 256``, linear warm-up then half-cycle cosine
    per iteration. The paper trains 90 epochs at batch 16384 on ImageNet; here the same recipe runs
    on cached features, so an epoch is a pass over tensors, not images. LARS scales each step by
    0.001 * |w| / |grad|, so it needs the paper's scale (thousands of steps, lr = 6.4): on small
    sets use ``optimizer="sgd"`` or a larger ``blr``, or the ``lbfgs`` probe.

    Args:
        features: (N, D) training features (cls token in the paper).
        labels: (N,) class indices.
        num_classes: C.
        epochs: passes over the features.
        batch_size: features per step.
        blr: base learning rate (paper 0.1).
        warmup_epochs: linear warm-up (paper 10).
        optimizer: ``"lars"`` (paper; timm's ``Lars``) or ``"sgd"`` (momentum 0.9, as MoCo v3).
        weight_decay: paper 0.
        seed: seeds the head's init and the batch order (an own generator: no global RNG use).

    Returns:
        A module (N, D) -> (N, C) logits in eval mode, on the features' device.
    """
    _check(features, labels, num_classes)
    if optimizer not in ("lars", "sgd"):
        raise ValueError(f"optimizer must be 'lars' or 'sgd', got {optimizer!r}")
    x, n = features.float(), features.shape[0]
    generator = torch.Generator().manual_seed(seed)
    linear = nn.utils.skip_init(nn.Linear, x.shape[1], num_classes)  # init below, own generator
    nn.init.trunc_normal_(linear.weight, std=0.01, generator=generator)
    nn.init.zeros_(linear.bias)
    head = nn.Sequential(nn.BatchNorm1d(x.shape[1], affine=False, eps=1e-6), linear).to(x.device)
    lr = blr * batch_size / 256
    # MAE's LARS (from MoCo v3) adapts the rate of weight matrices only; timm's Lars does that per
    # group with always_adapt (its default adapts only where weight decay is set).
    groups = [
        {"params": [linear.weight], "always_adapt": optimizer == "lars"},
        {"params": [linear.bias], "always_adapt": False},
    ]
    opt = Lars(groups, lr=lr, momentum=0.9, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(n / batch_size)
    total, warmup = epochs * steps_per_epoch, warmup_epochs * steps_per_epoch
    step = 0
    head.train()
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(x.device)
            for i in range(0, n, batch_size):
                idx = order[i : i + batch_size]
                if idx.numel() < 2:  # BatchNorm needs two samples to form batch statistics
                    continue
                # MAE's main_linprobe.py schedule (util/lr_sched.py, per fractional epoch): the
                # warm-up starts from 0 at step 0, where mmssl.optim.warmup_cosine (open_clip's
                # cosine_lr) starts from 1/warmup; the probe keeps MAE's, so its figures are MAE's.
                scale = step / max(1, warmup) if step < warmup else 0.5 * (
                    1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
                for group in opt.param_groups:
                    group["lr"] = lr * scale
                loss = F.cross_entropy(head(x[idx]), labels[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
    return head.eval()


def fit_adamw_cosine(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    weight_decay: float,
    lr: float = 0.1,
    epochs: int = 10,
    batch_size: int = 64,
    seed: int = 0,
) -> nn.Linear:
    """CLIP_benchmark's linear-probe fit (``clip_benchmark.metrics.linear_probe.train``, 1.6.2).

    A ``nn.Linear`` (default init after ``torch.manual_seed(seed)``), AdamW at ``lr`` with
    ``weight_decay`` on every parameter, cross-entropy, shuffled mini-batches of ``batch_size``,
    the learning rate set before each step to ``0.5 * (1 + cos(pi * step / steps)) * lr`` (its
    ``cosine_lr`` without warm-up), for ``epochs`` passes; fp32 (its ``--no_amp``). Written out
    rather than imported: clip_benchmark is not a dependency (it pins its own numpy) and asserts
    CUDA. The seed, the init and the batches' order are drawn as it draws them (the global RNG
    after ``manual_seed``, a ``DataLoader(shuffle=True)``), inside ``fork_rng`` so that the
    caller's RNG is left as it was. A short fixed schedule: on near-separable features it stops
    short of the optimum that :func:`fit_logistic` reaches (the suite names it protocol
    ``clip_benchmark`` to compare with CLIP_benchmark's figures, not to report the best probe).

    Args:
        features: (N, D) training features (CLIP_benchmark L2-normalises them first).
        labels: (N,) class indices.
        num_classes: C.
        weight_decay: AdamW's decoupled weight decay.
        lr: peak learning rate (``--fewshot_lr``).
        epochs: passes over the features (``--fewshot_epochs``).
        batch_size: mini-batch size (``--batch_size``).
        seed: ``--seed``.

    Returns:
        The trained (D -> C) layer.
    """
    _check(features, labels, num_classes)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features.float(), labels),
                                         batch_size=batch_size, shuffle=True)
    steps = max(epochs * len(loader), 1)  # LambdaLR evaluates step 0 even when no step runs
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(seed)
        model = nn.Linear(features.shape[1], num_classes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        # its cosine_lr without warm-up: lr at step s is 0.5 * (1 + cos(pi * s / steps)) * lr
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                schedule.step()
    return model.eval()


def fit_linear(features: Tensor, labels: Tensor, num_classes: int, method: str = "lbfgs", **kwargs) -> nn.Module:
    """Dispatch to ``fit_logistic`` (``"lbfgs"``) or ``fit_mae_linear`` (``"mae"``).

    Args:
        features: (N, D).
        labels: (N,).
        num_classes: C.
        method: ``"lbfgs"`` or ``"mae"``.
        **kwargs: passed to the fitting function.

    Returns:
        A module (N, D) -> (N, C) logits.
    """
    fits = {"lbfgs": fit_logistic, "mae": fit_mae_linear}
    if method not in fits:
        raise ValueError(f"probe method must be one of {METHODS}, got {method!r}")
    # Callbacks run inside Lightning's validation loop, under torch.inference_mode: gradients need
    # it switched off, and the cached features cloned out of inference tensors.
    with torch.inference_mode(False), torch.enable_grad():
        return fits[method](features.clone(), labels.clone(), num_classes, **kwargs)


@torch.no_grad()
def topk_accuracy(logits: Tensor, labels: Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Top-k accuracies (torchmetrics, micro average = fraction of samples right).

    Args:
        logits: (N, C) scores.
        labels: (N,) class indices.
        ks: the k's; those above C are skipped.

    Returns:
        ``{"top1": ..., "top5": ...}``.
    """
    num_classes = logits.shape[1]
    return {
        f"top{k}": float(multiclass_accuracy(logits, labels, num_classes, top_k=k, average="micro"))
        for k in ks if k <= num_classes
    }


def score_linear(
    train: FeatureSet,
    val: FeatureSet,
    index: int,
    num_classes: int,
    method: str,
    device: torch.device,
    **fit_kwargs,
) -> dict[str, Tensor]:
    """Fit a linear probe on ``train.features[index]`` and score it on this rank's ``val``.

    Args:
        train: all ranks' training features.
        val: this rank's validation features (may be empty).
        index: which feature tensor (0 = final, i = block i).
        num_classes: C.
        method: ``"lbfgs"`` or ``"mae"``.
        device: where to fit and score (the model's device, so metrics sync across ranks).
        **fit_kwargs: passed to the fitting function.

    Returns:
        ``{"top1", "top5"}`` accuracies reduced over ranks by torchmetrics.
    """
    classifier = fit_linear(
        train.features[index].to(device), train.labels.to(device), num_classes, method, **fit_kwargs
    )
    metrics = {
        f"top{k}": MulticlassAccuracy(num_classes, top_k=k, average="micro").to(device)
        for k in (1, 5) if k <= num_classes
    }
    if len(val):
        with torch.no_grad():
            logits = classifier(val.features[index].to(device))  # (N_val, C)
        for metric in metrics.values():
            metric.update(logits, val.labels.to(device))
    return {k: m.compute() for k, m in metrics.items()}
