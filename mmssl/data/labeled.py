"""Labelled evaluation sets loaded for the probes and zero-shot, in every layout of
:mod:`mmssl.data.label_files` (clip_benchmark ``wds/`` folders, shard folders with ``cls``, class
folders).

A sample whose ``cls`` is not a non-negative int64 (:func:`~mmssl.data.decode.parse_label`), or
whose image header claims more than ``max_image_pixels``, is a bad sample.

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
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadSample, open_image, parse_label
from mmssl.data.folders import LabeledFolder
from mmssl.data.label_files import is_image_folder, shard_urls
from mmssl.data.sources import is_local, shard_sizes
from mmssl.data.state import worker_arguments

log = logging.getLogger("mmssl.data")


def _decode_labeled(sample: dict, transform: Callable, image_keys: Sequence[str],
                    max_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[Any, int]:
    """Raw webdataset sample -> (transformed image, label); :class:`BadSample` says what is wrong."""
    key = next((k for k in image_keys if k in sample), None)
    if key is None or "cls" not in sample:
        raise BadSample(f"no image ({', '.join(image_keys)}) or no cls")
    try:
        label = parse_label(sample["cls"], name="cls")
    except ValueError as exn:
        raise BadSample(str(exn)) from None
    try:
        image = open_image(sample[key], max_pixels=max_pixels)
    except BadSample as exn:
        raise BadSample(f"{key}: {exn}") from None
    except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError... on bad data
        raise BadSample(f"unreadable {key} ({type(exn).__name__}: {exn})") from None
    return transform(image), label


def _captions(sample: dict) -> list[str]:
    """A sample's captions: the lines of its ``txt`` (clip_benchmark's retrieval sets), none without one."""
    raw = sample.get("txt", b"")
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    return [line.strip() for line in text.splitlines() if line.strip()]


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
        max_pixels: largest image decoded (width x height from its header); larger ones are bad.
        captions: batches also carry ``"captions"``, each sample's ``txt`` lines (retrieval).
    """

    def __init__(self, urls: Sequence[str], shards: Sequence[int], take: Optional[Sequence[int]],
                 transform: Callable, image_keys: Sequence[str], batch_size: int,
                 max_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS, captions: bool = False) -> None:
        self.urls, self.shards, self.take = list(urls), list(shards), take
        self.transform, self.image_keys, self.batch_size = transform, list(image_keys), batch_size
        self.max_pixels = max_pixels
        self.captions = captions

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
                    image, label = _decode_labeled(sample, self.transform, self.image_keys, self.max_pixels)
                except BadSample as exn:
                    skipped += 1
                    log.warning(f"labelled set: skipped sample {sample.get('__key__')!r} in {url}: {exn}")
                    continue
                rows.append((image, label, (shard << 32) + offset, *([_captions(sample)] if self.captions else [])))
                if len(rows) == self.batch_size:
                    yield _labeled_batch(rows, skipped)
                    rows, skipped = [], 0
        if rows or skipped:
            yield _labeled_batch(rows, skipped)


def _labeled_batch(rows: list[tuple[Any, ...]], skipped: int) -> dict[str, Any]:
    images = torch.stack([r[0] for r in rows]) if rows else torch.zeros(0)
    batch = {"image": images, "label": torch.tensor([r[1] for r in rows], dtype=torch.long),
             "index": torch.tensor([r[2] for r in rows], dtype=torch.long), "skipped": skipped}
    if rows and len(rows[0]) > 3:  # (image, label, index, captions)
        batch["captions"] = [r[3] for r in rows]
    return batch


def _collate_folder(batch: list) -> dict:
    """Rows of :class:`_Indexed` into a batch; a bad image's ``None`` row is counted as skipped."""
    rows = [row for row in batch if row is not None]
    return _labeled_batch(rows, len(batch) - len(rows))


class _Indexed(Dataset):
    """An image folder's samples with their index in the whole folder (the canonical order)."""

    def __init__(self, dataset: LabeledFolder, indices: range) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Optional[tuple[Any, int, int]]:
        item = self.dataset[self.indices[i]]
        return None if item is None else (*item, self.indices[i])


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
    max_image_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS,
    captions: bool = False,
) -> DataLoader:
    """Batches of this rank's part of a labelled set.

    Each batch is ``{"image": (B, 3, H, W), "label": (B,), "index": (B,), "skipped": int}``:
    ``index`` orders samples as one process would read them (shard by shard, or the image
    folder's order), ``skipped`` counts unreadable samples (see :class:`LabeledShards`).

    Args:
        data: clip_benchmark folder (its ``test`` split) or split folder, folder of ``*.tar``
            shards, brace pattern / ``::`` list of shards, or image folder.
        transform: PIL image -> tensor.
        batch_size: samples per batch.
        num_workers: loader workers.
        rank: this process's index; it reads shards (or images) ``rank::world_size``.
        world_size: number of processes sharing the set. A rank may get nothing when there are
            fewer shards than ranks; the callbacks handle empty parts.
        image_key: ``;``-separated image extensions (shards only).
        limit: read only the first ``limit`` samples of the whole set (in shard order, sizes
            from ``sizes.json`` or counted), so the subset is the same on any number of ranks.
        max_image_pixels: an image whose header claims more pixels is skipped, never decoded.
        captions: shard batches also carry ``"captions"`` (each sample's ``txt`` lines); an image
            folder has none, and is refused.

    Returns:
        A finite, unshuffled loader.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if is_image_folder(data):
        if captions:
            raise ValueError(f"labelled set {data!r} is an image folder: it has no captions for retrieval")
        dataset = LabeledFolder(data, transform, max_image_pixels)
        indices = range(rank, min(len(dataset), limit or len(dataset)), world_size)
        folder = _Indexed(dataset, indices)
        return DataLoader(folder, batch_size=batch_size, num_workers=num_workers, collate_fn=_collate_folder,
                          **worker_arguments(folder, num_workers, rank))
    urls = shard_urls(data)
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
    dataset = LabeledShards(urls, mine, take, transform, image_key.split(";"), batch_size, max_image_pixels, captions)
    # A rank with no shard gets an empty loader; workers would only warn about it.
    workers = min(num_workers, len(mine))
    return DataLoader(dataset, batch_size=None, num_workers=workers, **worker_arguments(dataset, workers, rank))
