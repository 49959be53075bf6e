"""Labelled evaluation sets in the layout clip_benchmark reads.

A folder holds webdataset shards whose samples carry ``cls`` (the label index) and an image, plus
``classnames.txt`` (one class name per line, in label order) and, optionally,
``zeroshot_classification_templates.txt`` (one prompt per line with ``{c}`` for the class name).
One folder thus serves mmssl's zero-shot and probe callbacks and clip_benchmark alike.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import webdataset as wds
from torch.utils.data import DataLoader, default_collate

from mmssl.data.webdataset import expand_urls

# A short set of CLIP's ImageNet prompts (Radford et al. 2021, notebook "Prompt_Engineering_for_
# ImageNet"), used when a folder ships no templates file.
DEFAULT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {c}.",
    "a bad photo of a {c}.",
    "a photo of the large {c}.",
    "a photo of the small {c}.",
    "a drawing of a {c}.",
    "a rendering of a {c}.",
    "itap of a {c}.",
)


def read_classnames(folder: str) -> list[str]:
    """Class names from ``folder/classnames.txt``, in label order."""
    path = os.path.join(folder, "classnames.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"labelled set {folder!r} has no classnames.txt")
    names = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
    if not names:
        raise ValueError(f"{path} lists no class names")
    return names


def read_templates(folder: str) -> list[str]:
    """Prompt templates from ``folder/zeroshot_classification_templates.txt``, else the defaults."""
    path = os.path.join(folder, "zeroshot_classification_templates.txt")
    if not os.path.isfile(path):
        return list(DEFAULT_TEMPLATES)
    templates = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
    bad = [t for t in templates if "{c}" not in t]
    if bad or not templates:
        raise ValueError(f"{path}: every template needs a '{{c}}' placeholder; bad: {bad[:3]}")
    return templates


class _LabeledSample:
    def __init__(self, transform: Callable, image_keys: list[str]):
        self.transform, self.image_keys = transform, image_keys

    def __call__(self, sample: dict) -> dict:
        image = next((sample[k] for k in self.image_keys if k in sample), None)
        if image is None or "cls" not in sample:
            raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')!r} lacks an image or cls")
        return {"image": self.transform(image), "label": int(sample["cls"])}


def labeled_loader(
    folder: str,
    transform: Callable,
    batch_size: int = 256,
    num_workers: int = 0,
    image_key: str = "jpg;jpeg;png;webp",
    split: Optional[Callable] = wds.split_by_node,
) -> DataLoader:
    """Batches of ``{"image": (B, 3, H, W), "label": (B,)}`` from the shards in ``folder``.

    Args:
        folder: the labelled set (its ``*.tar`` shards are read).
        transform: PIL image -> tensor.
        batch_size: samples per batch.
        num_workers: loader workers.
        image_key: ``;``-separated image extensions.
        split: how shards are divided across ranks (each rank reads its own part; the metrics
            reduce across ranks), ``None`` to read everything on every rank.

    Returns:
        A finite, unshuffled loader.
    """
    steps: list = [wds.SimpleShardList(expand_urls(folder))]
    if split is not None:
        steps.append(split)
    steps += [
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.map(_LabeledSample(transform, image_key.split(";")), handler=wds.warn_and_continue),
        wds.batched(batch_size, partial=True, collation_fn=default_collate),
    ]
    return DataLoader(wds.DataPipeline(*steps), batch_size=None, num_workers=num_workers)
