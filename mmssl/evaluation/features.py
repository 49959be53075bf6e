"""Frozen-feature extraction for probes: which feature, in what state, gathered how.

The probe protocol a model offers (MAE and CLIP in mmssl, timm / open_clip files via
``mmssl.evaluation.encoders``):

- ``encode_image(images) -> (B, D)``: the model's own embedding (CLIP: projected; MAE: cls);
- ``forward_features(images) -> (B, 1+L, D)``: final-norm tokens, cls first (timm's name);
- ``forward_intermediates(images, pool="cls"|"avg", norm=False) -> [(B, D)] * depth``: every
  block's pooled output from one forward pass, for layer-wise probes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Optional

import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn

Feature = Literal["cls", "avg", "embedding"]
FEATURES: tuple[str, ...] = ("cls", "avg", "embedding")


@contextlib.contextmanager
def frozen_eval(module: nn.Module) -> Iterator[nn.Module]:
    """Evaluate ``module`` without leaving a trace on training.

    Inside: every submodule in eval mode (dropout off, BatchNorm frozen), no autograd, and the
    torch / numpy / Python RNG states forked (Lightning's ``isolate_rng``), so a probe in the
    middle of training changes neither the next masks nor the data order. On exit each submodule
    gets back its own mode (not just the root's: a frozen tower may be in eval on purpose) and
    every parameter its ``requires_grad``.
    """
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.requires_grad) for p in module.parameters()]
    try:
        with isolate_rng(), torch.no_grad():
            module.eval()
            yield module
    finally:
        for m, training in modes:
            m.training = training
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)


def check_feature(feature: str) -> None:
    """Raise a clear error for an unknown feature type."""
    if feature not in FEATURES:
        raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")


def pool_tokens(tokens: Tensor, feature: str) -> Tensor:
    """(B, 1+L, D) tokens, cls first -> (B, D): the cls token or the mean of the patch tokens."""
    return tokens[:, 0] if feature == "cls" else tokens[:, 1:].mean(dim=1)


def check_probe_features(model: nn.Module, feature: str, layers: bool = False) -> None:
    """Refuse, before any image is read, features ``model`` cannot give (an export folder's CLIP
    gives its embedding only: open_clip and transformers have no token-level ``forward_features``).

    Raises:
        ValueError: an unknown ``feature``; ``"cls"`` / ``"avg"`` without ``forward_features``;
            ``layers`` without ``forward_intermediates``.
    """
    check_feature(feature)
    name = type(model).__name__
    if feature != "embedding" and not hasattr(model, "forward_features"):
        raise ValueError(f"feature {feature!r} pools the image tower's tokens, which {name} does not give "
                         "(no forward_features): probe its embedding (--feature embedding)")
    if layers and not hasattr(model, "forward_intermediates"):
        raise ValueError(f"{name} has no forward_intermediates(images, pool): layer-wise probing needs it "
                         "(MAE and CLIP with a ViT image tower have it)")


def image_features(model: nn.Module, images: Tensor, feature: str, layers: bool = False) -> list[Tensor]:
    """Features of one batch.

    Args:
        model: a module with the probe protocol above.
        images: (B, 3, H, W).
        feature: ``"cls"`` / ``"avg"`` from ``forward_features``, or ``"embedding"``
            (``encode_image``).
        layers: also return every block's pooled output (``forward_intermediates``, pooled the
            same way; ``"embedding"`` pools the cls token, as the MAE paper probes).

    Returns:
        ``[final]`` or ``[final, block_1, ..., block_depth]``, each (B, D_i) in float32.
    """
    if feature == "embedding":
        out = [model.encode_image(images)]
    else:
        out = [pool_tokens(model.forward_features(images), feature)]
    if layers:
        pool = "avg" if feature == "avg" else "cls"
        out += list(model.forward_intermediates(images, pool=pool))
    return [f.float() for f in out]


@dataclass
class FeatureSet:
    """Features of a labelled set: ``features[i]`` is (N, D_i), ``labels`` (N,).

    ``index`` (N,) is each sample's place in the whole set (``labeled_loader``), empty when the
    batches carried none; ``skipped`` counts the unreadable samples left out.
    """

    features: list[Tensor]
    labels: Tensor
    index: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    skipped: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def extract(
    model: nn.Module,
    batches: Iterable[dict],
    feature: str,
    layers: bool = False,
    device: Optional[torch.device] = None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> FeatureSet:
    """Run ``model`` frozen over ``batches`` and keep the features on the CPU.

    Args:
        model: a module with the probe protocol.
        batches: ``{"image", "label"}`` dicts (this rank's part of the set).
        feature: see ``image_features``.
        layers: also keep every block's features.
        device: where the images go (the model's device).
        context: e.g. the trainer's precision context (autocast), entered around each forward.

    Returns:
        The features; an empty set (zero rows, ``features == []``) if ``batches`` was empty.
    """
    check_probe_features(model, feature, layers)  # once, before the first batch is read
    chunks: list[list[Tensor]] = []
    labels: list[Tensor] = []
    index: list[Tensor] = []
    skipped = 0
    with frozen_eval(model):
        for batch in batches:
            skipped += int(batch.get("skipped", 0))
            if len(batch["label"]) == 0:  # a batch that only reports skipped samples
                continue
            with context():
                feats = image_features(model, batch["image"].to(device), feature, layers)
            chunks.append([f.cpu() for f in feats])
            labels.append(batch["label"].cpu().long())
            if "index" in batch:
                index.append(batch["index"].cpu().long())
    if not chunks:
        return FeatureSet([], torch.zeros(0, dtype=torch.long), skipped=skipped)
    order = torch.cat(index) if len(index) == len(labels) else torch.zeros(0, dtype=torch.long)
    return FeatureSet([torch.cat(c) for c in zip(*chunks)], torch.cat(labels), order, skipped)


def gather_feature_set(local: FeatureSet, all_gather: Callable[[Tensor], Tensor], world_size: int) -> FeatureSet:
    """Concatenate every rank's features (same result on every rank), for fitting a probe.

    Ranks hold different numbers of rows (shards split unevenly) and a rank may hold none, but
    ``all_gather`` needs equal shapes: the sizes are gathered first, each part padded to the
    largest, and the padding dropped after. ``all_gather`` is Lightning's (``strategy.all_gather``
    / ``LightningModule.all_gather``); at world size 1 this returns ``local`` as it is.

    Args:
        local: this rank's features.
        all_gather: tensor (…) -> (world_size, …) across ranks.
        world_size: number of ranks.

    Returns:
        All ranks' rows in the order of their ``index`` (the order one process reads them in,
        so a probe fitted on them is the same on any number of ranks), else rank 0's first;
        ``skipped`` summed over ranks.
    """
    if world_size == 1:
        return local
    # (n, number of feature tensors, D_1, ..., D_k): a rank with no rows reports zeros.
    dims = [f.shape[1] for f in local.features]
    meta = all_gather(torch.tensor([len(local), len(dims), local.skipped, len(local.index)]))  # (W, 4)
    sizes, largest = [int(n) for n in meta[:, 0]], int(meta[:, 0].max())
    skipped = int(meta[:, 2].sum())
    if largest == 0:
        return FeatureSet(local.features, local.labels, local.index, skipped)
    num_feats = int(meta[:, 1].max())
    dims_all = all_gather(torch.tensor(dims + [0] * (num_feats - len(dims)), dtype=torch.long))
    dims = [int(d) for d in dims_all.max(dim=0).values.reshape(-1)]

    def gather_rows(x: Tensor, width: Optional[int], dtype: torch.dtype) -> Tensor:
        shape = (largest,) if width is None else (largest, width)
        padded = torch.zeros(shape, dtype=dtype)
        padded[: len(local)] = x
        parts = all_gather(padded).cpu()  # (W, largest, ...)
        return torch.cat([parts[r, : sizes[r]] for r in range(world_size)])

    features = [
        gather_rows(local.features[i] if local.features else torch.zeros(0, d), d, torch.float32)
        for i, d in enumerate(dims)
    ]
    labels = gather_rows(local.labels, None, torch.long)
    if not bool((meta[:, 3] == meta[:, 0]).all()):  # some rank's rows carry no index
        return FeatureSet(features, labels, skipped=skipped)
    index = gather_rows(local.index, None, torch.long)
    order = torch.argsort(index)
    return FeatureSet([f[order] for f in features], labels[order], index[order], skipped)
