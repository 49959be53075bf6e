"""What the LightningModules compose: option groups and the held-out retrieval part.

A feature several models share is a part with its own config group, which a model takes whole:
``flip`` (:class:`mmssl.models.flip.Flip`), ``lock`` (:class:`mmssl.models.locking.LockOptions`),
``distill`` (:class:`mmssl.models.distill.Distillation`), ``lora`` (:mod:`mmssl.models.lora`).
LightningCLI reads each group as a nested YAML mapping (``model.init_args.flip.mask_ratio``); a
checkpoint records it as a plain dict (:func:`plain_groups`), so it stays data that the
weights-only reader loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, MetricCollection

from mmssl.retrieval import RECALL_AT, distributed_retrieval_hits

T = TypeVar("T")


def as_group(cls: type[T], value: Optional[Any], key: str) -> T:
    """An option group from what a config or a checkpoint holds: the dataclass, a mapping, or ``None``.

    Args:
        cls: the group's dataclass.
        value: an instance, a mapping of its fields (a checkpoint's hyper-parameters), or ``None``
            (the defaults).
        key: the config key, named in errors (``model.init_args.flip``).

    Raises:
        ValueError: a key the group does not have (the known ones are listed).
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: a mapping of {cls.__name__}'s options, got {value!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{key}: unknown options {unknown}; {cls.__name__} has {known}")
    return cls(**value)


def plain_groups(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The dataclass values of ``hparams`` as plain dicts (what a checkpoint records)."""
    return {k: dataclasses.asdict(v) for k, v in hparams.items()
            if dataclasses.is_dataclass(v) and not isinstance(v, type)}


class RetrievalValidation(nn.Module):
    """A contrastive model's held-out figures: ``val/loss`` and image<->text recall@k over the whole set.

    The loss of each batch is weighted by its size; the features of every batch are kept and
    scored together at the end of the epoch (:func:`mmssl.retrieval.distributed_retrieval_hits`,
    over all ranks). Sum-and-count metrics, reduced over ranks inside ``compute`` on every rank,
    including a rank whose share of the validation shards was empty (``sync_dist`` logging runs
    only on ranks that logged in a step, and hangs the others). Logged as metric objects, so
    Lightning computes and resets them at the end of the epoch on every rank.

    Args:
        embed_dim: the embedding width (for a rank with no batches).
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.loss = MeanMetric()
        self.retrieval = MetricCollection(
            {f"{d}_R@{k}": MeanMetric() for d in ("i2t", "t2i") for k in RECALL_AT}, prefix="val/")
        self.features: list[tuple[Tensor, Tensor]] = []

    def reset(self) -> None:
        self.features = []

    def update(self, image: Tensor, text: Tensor, loss: Tensor) -> None:
        """One batch: (B, D) image and text features, and its mean loss."""
        self.loss.update(loss.detach(), weight=image.shape[0])
        self.features.append((image.float(), text.float()))

    def log_to(self, module: Any) -> None:
        """Log ``val/loss`` and ``val/{i2t,t2i}_R@k`` through ``module.log`` (on every rank)."""
        module.log("val/loss", self.loss)
        empty = [(self.loss.mean_value.new_zeros(0, self.embed_dim),) * 2]
        pairs, self.features = self.features or empty, []
        image = F.normalize(torch.cat([p[0] for p in pairs]), dim=-1)  # (n_r, D)
        text = F.normalize(torch.cat([p[1] for p in pairs]), dim=-1)
        for key, hits in distributed_retrieval_hits(image, text).items():
            self.retrieval[key].update(hits)
        module.log_dict(self.retrieval)
