"""What the probe callbacks share: when to run, which data, and one cached feature extraction.

The linear-probe and k-NN callbacks read the same labelled sets through the same frozen model;
when both run on one validation with the same settings, the features are extracted once and
the second callback reuses them (cache keyed by trainer, step and settings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from mmssl.data.folders import folder_items
from mmssl.data.label_files import is_image_folder, read_classnames, shard_urls
from mmssl.data.labeled import labeled_loader
from mmssl.data.sources import is_local, shard_sizes
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import FeatureSet, extract, gather_feature_set


def should_run(trainer: pl.Trainer, every_n_epochs: int) -> bool:
    """On ``validate`` always; in ``fit`` after every n-th epoch, never in the sanity check."""
    if trainer.sanity_checking:
        return False
    if trainer.state.fn != "fit":
        return True
    return (trainer.current_epoch + 1) % every_n_epochs == 0


# The data module's sets an evaluation callback may read, in order of precedence: ``eval_data``,
# the labelled held-out set the data module names for evaluation (the demo's clip_benchmark split,
# with classnames and templates), before ``val_data``, the validation shards the loss is computed
# on, which need not be labelled.
DATAMODULE_EVAL_KEYS = ("eval_data", "val_data")


def evaluation_set(datamodule: Any, own: Optional[str] = None,
                   own_key: str = "init_args.data") -> Optional[tuple[str, str]]:
    """The set an evaluation callback reads, and the config key that named it (for messages).

    Precedence, the same for every callback (zero-shot, probes, captions, projector, health):
    the callback's own setting, else the data module's ``eval_data``, else its ``val_data``. Only
    a non-empty string counts: a list or dict of weighted sources is a training mixture, no one
    set to evaluate on, and is passed over.

    Args:
        datamodule: ``trainer.datamodule`` (may be ``None``, or lack either attribute).
        own: the callback's own setting (``init_args.data``), ``None`` or ``""`` for none.
        own_key: the config key of ``own``.

    Returns:
        ``(set, key)``, e.g. ``("/data/val", "data.eval_data")``, or ``None`` when there is none.
    """
    if own:
        return own, own_key
    for key in DATAMODULE_EVAL_KEYS:
        value = getattr(datamodule, key, None)
        if isinstance(value, str) and value:
            return value, f"data.{key}"
    return None


def default_data(trainer: pl.Trainer, train_data: Optional[str], val_data: Optional[str], who: str) -> tuple[str, str]:
    """The labelled (train, val) sets: the callback's own, else the data module's.

    The data module's training shards must carry ``cls`` (the demo's do); its held-out labelled
    set is chosen by :func:`evaluation_set`.
    """
    dm = trainer.datamodule
    train = train_data or getattr(dm, "train_data", None)
    found = evaluation_set(dm, val_data, "init_args.val_data")
    if not train or found is None:
        raise ValueError(
            f"{who}: the data module offers no labelled training and validation sets: pass "
            "--data.val_data LABELLED_SET (shards with cls beside a classnames.txt, or an image folder) "
            "with labelled --data.train_data, or set init_args.train_data and init_args.val_data in "
            f"its trainer.callbacks entry"
        )
    return train, found[0]


def will_evaluate(trainer: pl.Trainer, stage: str) -> bool:
    """Whether evaluation callbacks can run in this stage (``fit`` with validation switched off
    never calls them, so their data need not exist, e.g. for throughput benchmarks)."""
    return not (stage == "fit" and trainer.limit_val_batches == 0)


def check_labelled_set(data: str, who: str, key: str, need_classnames: bool = False) -> None:
    """Fail at start-up, on every rank alike, when a labelled set cannot be evaluated.

    Called from the callbacks' ``setup``, which runs on every rank before training, so a missing
    or empty set stops the whole job with the key named instead of one rank mid-run (which
    would leave the others waiting in a collective).

    Args:
        data: the labelled set (any layout of ``mmssl.data.label_files``: clip_benchmark folder or
            split, shard folder or pattern, image folder).
        who: the callback, for the message.
        key: the config key that set ``data``.
        need_classnames: the set must have ``classnames.txt`` (zero-shot); without it, a
            ``classnames.txt`` that is there is still checked (the probes count classes with it).
    """
    where = f"{who}: {key}={data!r}"
    if not is_image_folder(data):  # an image folder has a class sub-folder holding images
        try:  # a clip_benchmark folder without the split, or with a bad nshards.txt
            urls = shard_urls(data)
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from err
        missing = [u for u in urls if is_local(u) and not os.path.exists(u)]
        if not urls or missing:
            raise FileNotFoundError(f"{where}: no shards found{f', e.g. missing {missing[:3]}' if missing else ''}")
        sizes = shard_sizes(urls, scan=False)
        if sizes is not None and sum(sizes) == 0:
            raise ValueError(f"{where}: its sizes.json lists no samples")
    try:
        read_classnames(data)
    except FileNotFoundError as err:
        if need_classnames:
            raise FileNotFoundError(f"{where}: {err}") from err
    except ValueError as err:  # a blank line or a repeated name (line named), an empty file
        raise ValueError(f"{where}: {err}") from err


def check_labels(labels: Tensor, num_classes: int, data: str, who: str, reduce: Callable[[Tensor], Tensor],
                 index: Optional[Tensor] = None) -> None:
    """Raise on every rank when any rank holds a label outside ``[0, num_classes)``.

    A label list that does not cover the labels makes every figure wrong, so an evaluation set
    stops here rather than skipping such samples (the training stream skips them as bad).

    Args:
        labels: this rank's labels.
        num_classes: C (``classnames.txt``, or the largest label + 1).
        data: the labelled set, for the message.
        who: the callback.
        reduce: sum over ranks (``lambda t: all_gather(t).sum(0)``); every rank must call this.
        index: the samples' places in the set (``labeled_loader``), to name the first bad one.
    """
    outside = (labels < 0) | (labels >= num_classes)
    bad = int(reduce(outside.sum()))  # summed over ranks
    if bad:
        first = ""
        if index is not None and len(index) == len(labels) and bool(outside.any()):
            i = int(outside.nonzero()[0])
            first = f"; e.g. label {int(labels[i])} of {sample_name(data, int(index[i]))}"
        raise ValueError(f"{who}: labelled set {data!r} has {bad} labels outside [0, {num_classes}) "
                         f"({num_classes} classes in its classnames.txt or labels){first}; check its cls values")


def sample_name(data: str, index: int) -> str:
    """Where sample ``index`` (its place in the set, as ``labeled_loader`` numbers it) lies."""
    if is_image_folder(data):
        return repr(folder_items(data)[0][index][0])
    return f"sample {index & 0xFFFFFFFF} of shard {shard_urls(data)[index >> 32]}"


def num_classes_of(train: str, val: str, labels: torch.Tensor) -> int:
    """C from ``classnames.txt`` of the val (or train) set, else from the largest label seen."""
    for data in (val, train):
        try:
            return len(read_classnames(data))
        except FileNotFoundError:
            continue
    return int(labels.max()) + 1


@dataclass(frozen=True)
class ProbeSpec:
    """Settings that determine the extracted features (the cache key, with the step)."""

    train_data: str
    val_data: str
    feature: str
    layers: bool
    batch_size: int
    num_workers: int
    max_train_samples: Optional[int]


@dataclass
class ProbeFeatures:
    """All ranks' training features (identical on every rank) and this rank's val features."""

    train: FeatureSet
    val: FeatureSet
    num_classes: int
    skipped: int = 0  # unreadable samples of both sets, all ranks


_cache: dict[tuple, ProbeFeatures] = {}


def _loader(trainer: pl.Trainer, pl_module: pl.LightningModule, data: str, spec: ProbeSpec, limit: Optional[int]):
    transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
    # ``limit`` keeps the set's first samples in shard order: the same subset on any number of ranks.
    return labeled_loader(
        data, transform, spec.batch_size, spec.num_workers, trainer.global_rank, trainer.world_size, limit=limit
    )


def probe_features(trainer: pl.Trainer, pl_module: pl.LightningModule, spec: ProbeSpec) -> ProbeFeatures:
    """Extract (or reuse) frozen features of the labelled train and val sets.

    Each rank extracts its own part of both sets; the train parts are gathered with the
    strategy's ``all_gather`` (so every rank fits the same probe), the val parts stay local and
    the metrics reduce across ranks.
    """
    # The module too: mmssl.callbacks.EMA probes its averaged copy after the module itself.
    key = (id(trainer), id(pl_module), trainer.global_step, trainer.current_epoch, str(trainer.state.fn))
    for layers in ((True, False) if not spec.layers else (True,)):
        hit = _cache.get(key + (ProbeSpec(**{**spec.__dict__, "layers": layers}),))
        if hit is not None:
            return hit  # a layer-wise extraction holds the final features too
    _cache.clear()

    def context():
        return trainer.precision_plugin.forward_context()

    def run(data: str, limit: Optional[int]) -> FeatureSet:
        batches = _loader(trainer, pl_module, data, spec, limit)
        return extract(pl_module, batches, spec.feature, spec.layers, pl_module.device, context)

    train_local = run(spec.train_data, spec.max_train_samples)
    val = run(spec.val_data, None)
    train = gather_feature_set(
        train_local, lambda t: pl_module.all_gather(t.to(pl_module.device)), trainer.world_size
    )
    if len(train) == 0:
        raise ValueError(f"labelled train set {spec.train_data!r} yielded no samples")
    def reduce(t: Tensor) -> Tensor:
        gathered = pl_module.all_gather(t.to(pl_module.device)).cpu()
        return gathered.reshape(-1, *t.shape).sum(dim=0)

    val_skipped = int(reduce(torch.tensor(val.skipped)))
    num_classes = num_classes_of(spec.train_data, spec.val_data, train.labels)
    check_labels(
        train.labels, num_classes, spec.train_data, "probe", lambda t: t, train.index
    )  # gathered: same everywhere
    check_labels(val.labels, num_classes, spec.val_data, "probe", reduce, val.index)
    result = ProbeFeatures(train, val, num_classes, train.skipped + val_skipped)
    _cache[key + (spec,)] = result
    return result


def run_folder(trainer: pl.Trainer) -> str:
    """Where PNGs go: the first logger's folder (the run folder), else ``default_root_dir``.

    Purely local, so rank 0 may call it alone: ``trainer.log_dir`` broadcasts the folder from
    rank 0 under DDP, a collective that hangs when the other ranks do not call it too.
    """
    logger_dir = trainer.loggers[0].log_dir if trainer.loggers else None
    return logger_dir or trainer.default_root_dir or os.getcwd()
