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
gather or reduce the results, so nothing is counted twice, and unreadable samples are skipped and
counted, never dropped silently.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import webdataset as wds
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES as _OPENAI_TEMPLATE_FNS
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info
from torchvision.datasets import ImageFolder

from mmssl.data.decode import BadSample, open_image
from mmssl.data.sources import expand_urls, is_local, shard_sizes

log = logging.getLogger("mmssl.data")

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


def _decode_labeled(sample: dict, transform: Callable, image_keys: Sequence[str]) -> tuple[Any, int]:
    """Raw webdataset sample -> (transformed image, label); :class:`BadSample` says what is wrong."""
    key = next((k for k in image_keys if k in sample), None)
    if key is None or "cls" not in sample:
        raise BadSample(f"no image ({', '.join(image_keys)}) or no cls")
    try:
        label = int(sample["cls"].decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise BadSample(f"cls is not an integer: {sample['cls'][:20]!r}") from None
    try:
        image = open_image(sample[key])
    except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError... on bad data
        raise BadSample(f"unreadable {key} ({type(exn).__name__}: {exn})") from None
    return transform(image), label


class LabeledShards(IterableDataset):
    """One rank's shards of a labelled set as batches ``{"image", "label", "index", "skipped"}``.

    ``index`` is each sample's place in the whole set (shard number x 2^32 + position in the
    shard), so that parts read by different ranks can be put back in one order. Unreadable samples
    and tar members are skipped with a warning and counted: ``skipped`` holds the count since
    the worker's previous batch, and a worker left with only skipped samples yields a batch of
    zero rows to report them. A written webdataset pipeline (``wds.warn_and_continue``) would
    drop them uncounted, which is why this is not one.

    Args:
        urls: every shard of the set.
        shards: indices (into ``urls``) of the shards this rank reads.
        take: per shard, how many of its first samples to read (``None``: all).
        transform: PIL image -> tensor.
        image_keys: extensions holding the image.
        batch_size: samples per batch.
    """

    def __init__(self, urls: Sequence[str], shards: Sequence[int], take: Optional[Sequence[int]],
                 transform: Callable, image_keys: Sequence[str], batch_size: int) -> None:
        self.urls, self.shards, self.take = list(urls), list(shards), take
        self.transform, self.image_keys, self.batch_size = transform, list(image_keys), batch_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rows: list[tuple[Any, int, int]] = []
        skipped = 0

        def failed(url: str, exn: Exception) -> bool:
            nonlocal skipped
            skipped += 1
            log.warning(f"labelled set: skipped unreadable data in {url}: {type(exn).__name__}: {exn}")
            return True

        for shard in self.shards[worker::workers]:
            url, limit = self.urls[shard], None if self.take is None else self.take[shard]
            samples = wds.tarfile_samples([{"url": url}], handler=functools.partial(failed, url))
            for offset, sample in enumerate(itertools.islice(samples, limit)):
                try:
                    image, label = _decode_labeled(sample, self.transform, self.image_keys)
                except BadSample as exn:
                    skipped += 1
                    log.warning(f"labelled set: skipped sample {sample.get('__key__')!r} in {url}: {exn}")
                    continue
                rows.append((image, label, (shard << 32) + offset))
                if len(rows) == self.batch_size:
                    yield _labeled_batch(rows, skipped)
                    rows, skipped = [], 0
        if rows or skipped:
            yield _labeled_batch(rows, skipped)


def _labeled_batch(rows: list[tuple[Any, int, int]], skipped: int) -> dict[str, Any]:
    images = torch.stack([r[0] for r in rows]) if rows else torch.zeros(0)
    return {"image": images, "label": torch.tensor([r[1] for r in rows], dtype=torch.long),
            "index": torch.tensor([r[2] for r in rows], dtype=torch.long), "skipped": skipped}


def _collate_folder(batch: list) -> dict:
    images, labels, index = default_collate(batch)
    return {"image": images, "label": labels, "index": index, "skipped": 0}


class _Indexed(Dataset):
    """An image folder's samples with their index in the whole folder (the canonical order)."""

    def __init__(self, dataset: ImageFolder, indices: range) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        image, label = self.dataset[self.indices[i]]
        return image, label, self.indices[i]


def first_samples(sizes: Sequence[int], limit: Optional[int]) -> Optional[list[int]]:
    """Per shard, how many of its samples fall among the first ``limit`` of the set (shard order)."""
    if limit is None:
        return None
    take, left = [], limit
    for size in sizes:
        take.append(min(size, left))
        left -= take[-1]
    return take


def labeled_loader(
    data: str,
    transform: Callable,
    batch_size: int = 256,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    image_key: str = "jpg;jpeg;png;webp",
    limit: Optional[int] = None,
) -> DataLoader:
    """Batches of this rank's part of a labelled set.

    Each batch is ``{"image": (B, 3, H, W), "label": (B,), "index": (B,), "skipped": int}``:
    ``index`` orders samples as one process would read them (shard by shard, or the image
    folder's order), ``skipped`` counts unreadable samples (see :class:`LabeledShards`).

    Args:
        data: folder of ``*.tar`` shards, brace pattern / ``::`` list of shards, or image folder.
        transform: PIL image -> tensor.
        batch_size: samples per batch.
        num_workers: loader workers.
        rank: this process's index; it reads shards (or images) ``rank::world_size``.
        world_size: number of processes sharing the set. A rank may get nothing when there are
            fewer shards than ranks; the callbacks handle empty parts.
        image_key: ``;``-separated image extensions (shards only).
        limit: read only the first ``limit`` samples of the whole set (in shard order, sizes
            from ``sizes.json`` or counted), so the subset is the same on any number of ranks.

    Returns:
        A finite, unshuffled loader.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if is_image_folder(data):
        dataset = ImageFolder(data, transform=transform)
        indices = range(rank, min(len(dataset), limit or len(dataset)), world_size)
        return DataLoader(_Indexed(dataset, indices), batch_size=batch_size, num_workers=num_workers,
                          collate_fn=_collate_folder)
    urls = expand_urls(data)
    missing = [u for u in urls if is_local(u) and not os.path.exists(u)]
    if missing:
        raise FileNotFoundError(f"labelled set {data!r}: no such shard(s) {missing[:3]}")
    take = None
    if limit is not None:
        sizes = shard_sizes(urls)
        if sizes is None:
            raise ValueError(f"labelled set {data!r}: a sample limit needs the shard sizes (sizes.json)")
        take = first_samples(sizes, limit)
    # Explicit shard split (not wds.split_by_node): the offline tools have no process group, and
    # rank/world come from the trainer, so the split is the same whatever launched the job.
    mine = [i for i in range(rank, len(urls), world_size) if take is None or take[i] > 0]
    dataset = LabeledShards(urls, mine, take, transform, image_key.split(";"), batch_size)
    # A rank with no shard gets an empty loader; workers would only warn about it.
    return DataLoader(dataset, batch_size=None, num_workers=min(num_workers, len(mine)))
