"""Score a loaded model on labelled sets in one process: what ``tools/linear_probe.py`` and
``tools/zero_shot.py`` run, without a Trainer."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
from torch import nn

from mmssl.data.label_files import read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import extract
from mmssl.evaluation.knn import knn_scores
from mmssl.evaluation.linear import score_linear, topk_accuracy
from mmssl.evaluation.online import num_classes_of
from mmssl.evaluation.report import write_json
from mmssl.evaluation.zero_shot import zero_shot_evaluate


def check_data(path: str, option: str = "--data") -> None:
    """Refuse a labelled set's path that names nothing, before a model is loaded (the set's side files,
    ``classnames.txt``, would be looked for at ``/classnames.txt`` and named instead). A shard pattern
    (``{00000..00009}``) or a URL is left to the reader.

    Raises:
        FileNotFoundError: no file or folder at ``path``, naming the option and the path.
    """
    if "{" in path or "://" in path or path.startswith("pipe:") or os.path.exists(os.path.expanduser(path)):
        return
    raise FileNotFoundError(f"{option} {path!r}: no such file or folder (a labelled set: a folder of shards or "
                            "class folders, a clip_benchmark split, or a shard pattern)")


def _loader(model: nn.Module, data: str, batch_size: int, num_workers: int):
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    return labeled_loader(data, transform, batch_size, num_workers)


def linear_probe_report(
    model: nn.Module,
    train_data: str,
    val_data: str,
    feature: str = "cls",
    method: str = "lbfgs",
    layers: bool = False,
    knn_k: int = 20,
    knn_temperature: float = 0.07,
    batch_size: int = 256,
    num_workers: int = 0,
    device: Optional[torch.device] = None,
    fit_kwargs: Optional[dict] = None,
) -> dict:
    """Extract features once, fit the linear probe (per block if ``layers``) and the k-NN.

    Args:
        model: a module with the probe protocol and ``image_size``/``image_mean``/``image_std``.
        train_data: labelled training set.
        val_data: labelled evaluation set.
        feature: ``"cls"``, ``"avg"`` or ``"embedding"``.
        method: ``"lbfgs"`` or ``"mae"``.
        layers: probe every block too.
        knn_k: k of the weighted k-NN (0 skips it).
        knn_temperature: its temperature.
        batch_size: images per extraction batch.
        num_workers: loader workers.
        device: where to run (default: CUDA if available, else CPU).
        fit_kwargs: extra arguments of the fitting function.

    Returns:
        A JSON-ready dict: ``top1``, ``top5``, ``knn_top1``, ``knn_top5``, ``feature``,
        ``method``, ``num_train``, ``num_val``, ``num_classes``, ``layers`` (per-block list),
        ``seconds``.
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model.to(device)
    train = extract(model, _loader(model, train_data, batch_size, num_workers), feature, layers, device)
    val = extract(model, _loader(model, val_data, batch_size, num_workers), feature, layers, device)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(
            f"empty labelled set: {len(train)} train samples in {train_data!r}, {len(val)} val in {val_data!r}"
        )
    num_classes = num_classes_of(train_data, val_data, train.labels)
    fit = fit_kwargs or {}
    final = score_linear(train, val, 0, num_classes, method, device, **fit)
    report: dict = {
        "top1": float(final["top1"]), "top5": float(final["top5"]) if "top5" in final else None,
        "feature": feature, "method": method, "num_train": len(train), "num_val": len(val),
        "num_classes": num_classes, "feature_dim": int(train.features[0].shape[1]),
    }
    if knn_k:
        scores = knn_scores(train.features[0].to(device), train.labels.to(device),
                            val.features[0].to(device), num_classes, knn_k, knn_temperature)
        knn = topk_accuracy(scores, val.labels.to(device))
        report.update(knn_top1=knn["top1"], knn_top5=knn.get("top5"), knn_k=knn_k, knn_temperature=knn_temperature)
    if layers:
        report["layers"] = []
        for i in range(1, len(train.features)):
            acc = score_linear(train, val, i, num_classes, method, device, **fit)
            report["layers"].append({"block": i, **{k: float(v) for k, v in acc.items()}})
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def zero_shot_report(
    model: nn.Module,
    data: str,
    classnames: Optional[str] = None,
    templates: Optional[str] = None,
    batch_size: int = 256,
    num_workers: int = 0,
    device: Optional[torch.device] = None,
) -> dict:
    """Zero-shot top-1/top-5 of a CLIP-like model on a labelled set.

    Args:
        model: with ``encode_image``, ``encode_text``, ``tokenizer``, ``image_size``, ...
        data: the labelled set.
        classnames: class-names file (default ``classnames.txt`` beside the data).
        templates: templates file (default beside the data, else CLIP's 80 ImageNet prompts).
        batch_size: images per batch.
        num_workers: loader workers.
        device: where to run (default: CUDA if available, else CPU).

    Returns:
        A JSON-ready dict: ``top1``, ``top5``, ``num_samples``, ``skipped``, ``num_classes``,
        ``num_templates``, ``feature`` (``"embedding"``), ``seconds``.
    """
    if not all(hasattr(model, a) for a in ("encode_text", "tokenizer")):
        raise TypeError(f"{type(model).__name__} has no text tower: zero-shot needs a CLIP model")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    names, prompts = read_classnames(data, classnames), read_templates(data, templates)
    model.to(device)
    out = zero_shot_evaluate(model, _loader(model, data, batch_size, num_workers), names, prompts, device)
    return {
        "top1": float(out["top1"]), "top5": float(out["top5"]) if "top5" in out else None,
        "feature": "embedding", "num_samples": int(out["num_samples"]), "skipped": int(out["skipped"]),
        "num_classes": len(names),
        "num_templates": len(prompts), "seconds": round(time.perf_counter() - start, 3),
    }


def format_table(report: dict, title: str) -> str:
    """A readable two-column table of a report (per-block rows for layer-wise probes)."""
    rows = [(k, v) for k, v in report.items() if k != "layers"]
    rows += [(f"block {b['block']} top1", b["top1"]) for b in report.get("layers", [])]
    width = max(len(str(k)) for k, _ in rows)
    lines = [title, "-" * (width + 14)]
    for key, value in rows:
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {text:>10}")
    return "\n".join(lines)


def emit_report(report: dict, title: str, output_json: Optional[str] = None) -> None:
    """Print ``report`` as a table and, if asked, write it as JSON (what both probe tools end with).

    Args:
        report: the figures (``top1``, ``top5``, sizes, ...).
        title: the table's heading.
        output_json: path of the JSON file, or ``None`` for none.
    """
    print(format_table(report, title))
    if output_json:
        write_json(output_json, report)  # atomically: a kill leaves the previous results whole
        print(f"wrote {output_json}")
