"""Labelled evaluation sets, in the two layouts users have: shards with ``cls`` and class folders.

1. **Webdataset shards** (the layout clip_benchmark reads): a folder of ``*.tar`` shards (or a
   brace pattern / ``::``-joined list) whose samples carry an image and ``cls`` (the label index),
   plus ``classnames.txt`` (one class name per line, in label order) and, optionally,
   ``zeroshot_classification_templates.txt`` (one prompt per line with ``{c}`` for the class).
2. **Image folders** (torchvision ``ImageFolder``, the ImageNet layout): one sub-folder per class;
   labels follow the sorted folder names, and class names come from ``classnames.txt`` when
   present, else from the folder names.

One folder thus serves mmssl's zero-shot and probe callbacks, the offline tools and clip_benchmark.
Each rank reads its own part (shards ``rank::world`` or images ``rank::world``); the callbacks
gather or reduce the results, so nothing is counted twice.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import webdataset as wds
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES as _OPENAI_TEMPLATE_FNS
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision.datasets import ImageFolder

from mmssl.data.webdataset import expand_urls

# The 80 ImageNet prompts of CLIP (Radford et al. 2021, notebook "Prompt_Engineering_for_ImageNet"),
# taken from the copy open_clip ships (``zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES``, lambdas)
# and written with the ``{c}`` placeholder our template files use. Used when a set has no file.
OPENAI_IMAGENET_TEMPLATES: tuple[str, ...] = tuple(fn("{c}") for fn in _OPENAI_TEMPLATE_FNS)
DEFAULT_TEMPLATES = OPENAI_IMAGENET_TEMPLATES
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"


def _meta_folder(data: str) -> str:
    """Folder holding ``classnames.txt``: the set itself, or the folder of its first shard."""
    if os.path.isdir(data):
        return data
    return os.path.dirname(expand_urls(data)[0])


def is_image_folder(data: str) -> bool:
    """True when ``data`` is a folder of class sub-folders (and no ``*.tar`` shards)."""
    if not os.path.isdir(data):
        return False
    entries = os.listdir(data)
    has_tars = any(e.endswith(".tar") for e in entries)
    return not has_tars and any(os.path.isdir(os.path.join(data, e)) for e in entries)


def read_classnames(data: str, path: Optional[str] = None) -> list[str]:
    """Class names in label order.

    Args:
        data: the labelled set (folder of shards, shard pattern, or image folder).
        path: an explicit class-names file; defaults to ``classnames.txt`` beside the data.

    Returns:
        One name per class. An image folder without ``classnames.txt`` names its classes after
        its sorted sub-folders (``_`` read as a space).
    """
    path = path or os.path.join(_meta_folder(data), CLASSNAMES_FILE)
    if not os.path.isfile(path):
        if is_image_folder(data):
            return [c.replace("_", " ") for c in ImageFolder.find_classes(data)[0]]
        raise FileNotFoundError(f"labelled set {data!r} has no {CLASSNAMES_FILE} (looked for {path!r})")
    with open(path, encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip()]
    if not names:
        raise ValueError(f"{path} lists no class names")
    return names


def read_templates(data: str, path: Optional[str] = None) -> list[str]:
    """Zero-shot prompt templates, each with a ``{c}`` placeholder.

    Args:
        data: the labelled set.
        path: an explicit templates file; defaults to ``zeroshot_classification_templates.txt``
            beside the data.

    Returns:
        The file's templates, or CLIP's 80 ImageNet templates when there is no file.
    """
    explicit = path is not None
    path = path or os.path.join(_meta_folder(data), TEMPLATES_FILE)
    if not os.path.isfile(path):
        if explicit:
            raise FileNotFoundError(f"no templates file at {path!r}")
        return list(DEFAULT_TEMPLATES)
    with open(path, encoding="utf-8") as f:
        templates = [line.strip() for line in f if line.strip()]
    bad = [t for t in templates if "{c}" not in t]
    if bad or not templates:
        raise ValueError(f"{path}: every template needs a '{{c}}' placeholder; bad: {bad[:3]}")
    return templates


class _LabeledSample:
    """Decoded webdataset sample -> ``{"image", "label"}`` (a class, so it pickles into workers)."""

    def __init__(self, transform: Callable, image_keys: list[str]):
        self.transform, self.image_keys = transform, image_keys

    def __call__(self, sample: dict) -> dict:
        image = next((sample[k] for k in self.image_keys if k in sample), None)
        if image is None or "cls" not in sample:
            raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')!r} lacks an image or cls")
        return {"image": self.transform(image), "label": int(sample["cls"])}


def _collate_folder(batch: list) -> dict:
    images, labels = default_collate(batch)
    return {"image": images, "label": labels}


def labeled_loader(
    data: str,
    transform: Callable,
    batch_size: int = 256,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    image_key: str = "jpg;jpeg;png;webp",
) -> DataLoader:
    """Batches of ``{"image": (B, 3, H, W), "label": (B,)}`` of this rank's part of a labelled set.

    Args:
        data: folder of ``*.tar`` shards, brace pattern / ``::`` list of shards, or image folder.
        transform: PIL image -> tensor.
        batch_size: samples per batch.
        num_workers: loader workers.
        rank: this process's index; it reads shards (or images) ``rank::world_size``.
        world_size: number of processes sharing the set. A rank may get nothing when there are
            fewer shards than ranks; the callbacks handle empty parts.
        image_key: ``;``-separated image extensions (shards only).

    Returns:
        A finite, unshuffled loader.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if is_image_folder(data):
        dataset = ImageFolder(data, transform=transform)
        part = Subset(dataset, range(rank, len(dataset), world_size))
        return DataLoader(part, batch_size=batch_size, num_workers=num_workers, collate_fn=_collate_folder)
    urls = expand_urls(data)
    missing = [u for u in urls if "://" not in u and not u.startswith("pipe:") and not os.path.exists(u)]
    if missing:
        raise FileNotFoundError(f"labelled set {data!r}: no such shard(s) {missing[:3]}")
    # Explicit shard split (not wds.split_by_node): the offline tools have no process group, and
    # rank/world come from the trainer, so the split is the same whatever launched the job.
    steps: list = [
        wds.SimpleShardList(urls[rank::world_size]),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.map(_LabeledSample(transform, image_key.split(";")), handler=wds.warn_and_continue),
        wds.batched(batch_size, partial=True, collation_fn=default_collate),
    ]
    # A rank with no shard gets an empty loader; workers would only warn about it.
    workers = num_workers if urls[rank::world_size] else 0
    return DataLoader(wds.DataPipeline(*steps), batch_size=None, num_workers=workers)
