"""Run a suite (:mod:`mmssl.evaluation.suite`) on one model: every split encoded once, every task
scored on those features, every figure with its bootstrap draws.

The images of a split are encoded in one pass (labels, and the captions when a set asks for
retrieval, read in the same pass) and the features kept for every set and task that names the
split; the text tower encodes each set's prompts and captions once. A progress bar per set counts
its images; unreadable samples are skipped, counted, and reported in the set's JSON.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from mmssl.data.label_files import shard_urls
from mmssl.data.labeled import labeled_loader
from mmssl.data.sources import shard_sizes
from mmssl.data.transforms import eval_transform
from mmssl.evaluation import protocols
from mmssl.evaluation.bootstrap import Figure, bootstrap_draws, draw_counts, percentile_interval
from mmssl.evaluation.features import frozen_eval, image_features
from mmssl.evaluation.online import check_labels
from mmssl.evaluation.suite import SetSpec, Suite
from mmssl.evaluation.zero_shot import build_zero_shot_classifier
from mmssl.retrieval import tied_rows

# CLIP_benchmark's task names for the suite's tasks (k-NN has none there: named as here).
CB_TASK = {"zero_shot": "zeroshot_classification", "linear_probe": "linear_probe", "knn": "knn",
           "retrieval": "zeroshot_retrieval"}
# The one figure of each task the suite averages over sets (DataComp averages one per task).
MAIN_METRIC = {"zero_shot": "acc1", "linear_probe": "lp_acc1", "knn": "acc1", "retrieval": "mean_recall@1"}


def set_seed(seed: int, name: str) -> int:
    """The bootstrap seed of one set: the same draws for every figure and every model on the set
    (figures and models are then paired), other draws for other sets (their averages' draws independent)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % 2**62


@dataclass
class Split:
    """The encoded images of one split: ``features`` (N, D), ``labels`` (N,), ``index`` (N,) each
    sample's place in the set, ``captions`` (per image, when read), ``skipped`` unreadable samples."""

    features: Tensor
    labels: Tensor
    index: Tensor
    skipped: int
    captions: Optional[list[list[str]]] = None


@dataclass
class Result:
    """One set, task and protocol: figures with their draws, the units' ids, the protocol's settings."""

    set: str
    task: str
    protocol: str
    figures: dict[str, Figure]
    units: Tensor
    draws: dict[str, Tensor]
    settings: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0
    skipped: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {name: fig.point() for name, fig in self.figures.items()}

    def intervals(self) -> dict[str, tuple[float, float]]:
        return {name: percentile_interval(d) for name, d in self.draws.items()}


def _num_samples(data: str, limit: Optional[int]) -> Optional[int]:
    """The split's size for the progress bar, from ``sizes.json`` (``None`` when unknown)."""
    try:
        sizes = shard_sizes(shard_urls(data))
    except (OSError, ValueError):
        sizes = None
    total = sum(sizes) if sizes else None
    return min(total, limit) if total is not None and limit else total or limit


def encode_split(model: nn.Module, data: str, limit: Optional[int], captions: bool, feature: str,
                 batch_size: int, num_workers: int, device: torch.device, bar: tqdm) -> Split:
    """Encode a split's images once (frozen, eval mode), labels and captions read in the same pass.

    Args:
        model: with the probe protocol and ``image_size`` / ``image_mean`` / ``image_std``.
        data: the split (any labelled-set layout).
        limit: its first N samples only.
        captions: also read each sample's ``txt`` lines.
        feature: ``embedding`` / ``cls`` / ``avg`` (:func:`mmssl.evaluation.features.image_features`).
        batch_size, num_workers: the loader's.
        device: the model's.
        bar: the set's progress bar, advanced per batch.

    Returns:
        The split's features on the CPU.
    """
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    loader = labeled_loader(data, transform, batch_size, num_workers, limit=limit, captions=captions)
    feats, labels, index, texts, skipped = [], [], [], [], 0
    with frozen_eval(model):
        for batch in loader:
            skipped += int(batch.get("skipped", 0))
            if len(batch["label"]) == 0:
                continue
            feats.append(image_features(model, batch["image"].to(device), feature)[0].cpu())
            labels.append(batch["label"])
            index.append(batch["index"])
            texts.extend(batch.get("captions", [[] for _ in range(len(batch["label"]))]))
            bar.update(len(batch["label"]))
    if not feats:
        raise ValueError(f"{data}: no readable samples ({skipped} skipped)")
    return Split(torch.cat(feats), torch.cat(labels), torch.cat(index), skipped, texts if captions else None)


@torch.no_grad()
def encode_captions(model: nn.Module, captions: list[list[str]], device: torch.device,
                    batch_size: int = 256) -> tuple[Tensor, Tensor]:
    """(M, D) L2-normalised embeddings of every caption, and (M,) the image each belongs to."""
    flat = [(i, text) for i, texts in enumerate(captions) for text in texts]
    if not flat:
        raise ValueError("retrieval: no captions (the set's samples have no txt)")
    out = []
    with frozen_eval(model):
        for start in range(0, len(flat), batch_size):
            tokens = model.tokenizer([t for _, t in flat[start:start + batch_size]]).to(device)
            out.append(F.normalize(model.encode_text(tokens).float(), dim=-1).cpu())
    return torch.cat(out), torch.tensor([i for i, _ in flat], dtype=torch.long)


class Runner:
    """Scores one model on a suite; splits shared by several sets are encoded once.

    Args:
        model: the loaded model (:func:`mmssl.evaluation.encoders.load_encoder`).
        suite: the checked suite.
        feature: the image feature every task uses (``embedding``: ``encode_image``).
        batch_size, num_workers: the loaders'.
        device: where the model runs.
    """

    def __init__(self, model: nn.Module, suite: Suite, feature: str = "embedding", batch_size: int = 256,
                 num_workers: int = 0, device: Optional[torch.device] = None) -> None:
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.suite, self.feature = model.to(self.device), suite, feature
        self.batch_size, self.num_workers = batch_size, num_workers
        self._splits: dict[tuple[str, Optional[int]], Split] = {}
        # A split read for retrieval by any set is read with its captions, once, for all of them.
        self._captions = {(s.test, s.limit_test) for s in suite.sets if s.task("retrieval")}

    def split(self, data: str, limit: Optional[int], bar: tqdm) -> Split:
        key = (data, limit)
        if key not in self._splits:
            self._splits[key] = encode_split(self.model, data, limit, key in self._captions, self.feature,
                                             self.batch_size, self.num_workers, self.device, bar)
        return self._splits[key]

    def run(self, log: Callable[[str], None] = lambda _: None) -> list[Result]:
        """Every set's tasks; ``log`` gets one line per result."""
        results = []
        for spec in self.suite.sets:
            results += self.run_set(spec, log)
        return results

    def _needs_text(self, spec: SetSpec) -> bool:
        wants = any(spec.task(t) for t in ("zero_shot", "retrieval"))
        if wants and not all(hasattr(self.model, a) for a in ("encode_text", "tokenizer")):
            return False
        return wants

    def run_set(self, spec: SetSpec, log: Callable[[str], None]) -> list[Result]:
        """One set: its splits encoded (once), then each task and protocol scored."""
        splits = [(spec.test, spec.limit_test)] + ([(spec.train, spec.limit_train)] if spec.train else [])
        val = spec.task("linear_probe").options.get("val") if spec.task("linear_probe") else None
        splits += [(val, None)] if val else []
        total = [_num_samples(d, lim) for d, lim in splits if (d, lim) not in self._splits]
        with tqdm(total=sum(t or 0 for t in total) or None, desc=spec.name, unit="img", leave=False) as bar:
            encoded = [self.split(d, lim, bar) for d, lim in splits]
        test, train = encoded[0], encoded[1] if spec.train else None
        num_classes = len(spec.classnames) if spec.classnames else int(
            max(test.labels.max(), train.labels.max() if train is not None else 0)) + 1
        for (data, _), split in zip(splits, encoded):  # a class list that misses labels makes every figure wrong
            check_labels(split.labels, num_classes, data, f"suite set {spec.name!r}", lambda t: t, split.index)
        results = []
        for task in spec.tasks:
            if task.name in ("zero_shot", "retrieval") and not self._needs_text(spec):
                log(f"{spec.name}: {task.name} skipped: {type(self.model).__name__} has no text tower")
                continue
            for protocol in task.protocols:
                start = time.perf_counter()
                figures, units, settings = self._score(spec, task.name, task.options, protocol, test, train,
                                                       encoded[2] if val else None, num_classes)
                result = self._result(spec, task.name, protocol, figures, units, settings, test)
                result.seconds = round(time.perf_counter() - start, 3)
                results.append(result)
                main = MAIN_METRIC[task.name]
                log(f"{spec.name} {task.name} ({protocol}): {main} {100 * result.metrics()[main]:.2f}")
        return results

    def _score(self, spec: SetSpec, task: str, options: dict, protocol: str, test: Split, train: Optional[Split],
               val: Optional[Split], num_classes: int) -> tuple[dict[str, Figure], Tensor, dict]:
        if task == "zero_shot":
            classifier = build_zero_shot_classifier(self.model.encode_text, self.model.tokenizer, spec.classnames,
                                                    spec.templates, self.device).cpu()
            return protocols.zero_shot(test.features, test.labels, classifier), test.index, {
                "num_templates": len(spec.templates), "num_classes": num_classes}
        if task == "retrieval":
            text, owner = encode_captions(self.model, test.captions or [], self.device)
            image = F.normalize(test.features.float(), dim=-1)
            ks = options.get("recall_k", [1, 5, 10])
            # Items that tie with a duplicate (mmssl.retrieval's convention ranks the lower index first).
            settings = {"num_captions": int(owner.shape[0]), "tied_captions": tied_rows(text),
                        "tied_images": tied_rows(image)}
            return protocols.retrieval(image, text, owner, ks), test.index, settings
        assert train is not None  # the suite refuses probes without a train set
        if task == "knn":
            figures, settings = protocols.knn(train.features, train.labels, test.features, test.labels,
                                              num_classes, protocol)
            return figures, test.index, {**settings, "num_train": len(train.labels), "skipped_train": train.skipped}
        held_out = (val.features, val.labels) if val is not None else None
        figures, settings = protocols.linear_probe(train.features, train.labels, test.features, test.labels,
                                                   num_classes, protocol, options, self.suite.seed, held_out)
        return figures, test.index, {**settings, "num_train": len(train.labels), "skipped_train": train.skipped,
                                     "seed": self.suite.seed}

    def _result(self, spec: SetSpec, task: str, protocol: str, figures: dict[str, Figure], units: Tensor,
                settings: dict, test: Split) -> Result:
        weights = draw_counts(len(units), self.suite.resamples, set_seed(self.suite.seed, spec.name))
        return Result(spec.name, task, protocol, figures, units, bootstrap_draws(figures, weights), settings,
                      num_samples=len(units), skipped=test.skipped)
