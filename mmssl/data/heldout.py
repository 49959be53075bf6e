"""A fixed held-out buffer: the first N samples of a set, images and (for CLIP) captions.

The health callback embeds the same samples at every call, so its figures move only with the
model. Every rank reads the whole buffer (the set's first N samples in shard order, the order one
process reads them in) and embeds an equal slice of it: the buffer is the same on any number of
ranks by construction, and every rank runs the same number of forwards (under FSDP each forward
is a collective). N is small (hundreds), so reading it once per rank costs little.

Labels are not needed: image-text shards (``txt``, as training reads them) and labelled sets of
:mod:`mmssl.data.label_files` (shards, clip_benchmark splits, image folders) all serve.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import webdataset as wds
from torch import Tensor

from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadSample, SampleDecoder
from mmssl.data.folders import LabeledFolder
from mmssl.data.label_files import is_image_folder, shard_urls
from mmssl.data.sources import is_local

log = logging.getLogger("mmssl.data")

__all__ = ["HeldOut", "read_heldout"]


@dataclass
class HeldOut:
    """``images`` (N, 3, H, W), ``tokens`` (N, L) when captions were read, unreadable samples skipped."""

    images: Tensor
    tokens: Optional[Tensor]
    skipped: int = 0

    def __len__(self) -> int:
        return int(self.images.shape[0])


def _shard_samples(data: str, decoder: SampleDecoder, counter: list[int]) -> Iterator[dict]:
    """Decoded samples of every shard, in order; a bad sample or tar member bumps ``counter[0]``."""
    urls = shard_urls(data)
    missing = [u for u in urls if is_local(u) and not os.path.exists(u)]
    if missing:
        raise FileNotFoundError(f"no such shard(s) {missing[:3]}")
    for url in urls:
        def failed(exn: Exception, url: str = url) -> bool:
            counter[0] += 1
            log.warning(f"held-out buffer: skipped unreadable data in {url}: {type(exn).__name__}: {exn}")
            return True

        # webdataset's tarfile_samples never closes the file it opens; the buffer opens it itself.
        try:
            stream = wds.gopen(url)
        except Exception as exn:  # a shard that cannot be opened is skipped like a bad member
            failed(exn)
            continue
        with contextlib.closing(stream):
            files = wds.tariterators.tar_file_expander([{"url": url, "stream": stream}], handler=failed)
            for raw in wds.tariterators.group_by_keys(files, handler=failed):
                try:
                    sample = decoder(raw)
                except BadSample as exn:
                    counter[0] += 1
                    log.warning(f"held-out buffer: skipped sample {raw.get('__key__')!r} in {url}: {exn}")
                    continue
                sample.pop("label", None)  # not needed; a set may carry it on some samples only
                yield sample


def _folder_samples(data: str, transform: Callable, max_pixels: Optional[int], counter: list[int]) -> Iterator[dict]:
    folder = LabeledFolder(data, transform, max_pixels)  # it names and warns about a bad image
    for i in range(len(folder)):
        item = folder[i]
        if item is None:
            counter[0] += 1
            continue
        yield {"image": item[0]}


def read_heldout(
    data: str,
    transform: Callable,
    tokenizer: Optional[Callable] = None,
    limit: int = 512,
    image_key: str = "jpg;jpeg;png;webp",
    text_key: str = "txt",
    max_image_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS,
) -> HeldOut:
    """The first ``limit`` readable samples of ``data``, in one process's reading order.

    Args:
        data: shards (brace pattern, ``::`` list, folder of ``*.tar``, clip_benchmark split) or an
            image folder (images only).
        transform: PIL image -> (3, H, W) tensor (the eval transform).
        tokenizer: captions -> (B, L) tokens; ``None`` reads images only. With a tokenizer, a
            sample without a caption is skipped (a folder has none: tokens stay ``None``).
        limit: N, the buffer's size.
        image_key: ``;``-separated image extensions (shards).
        text_key: the caption's extension (shards).
        max_image_pixels: an image whose header claims more pixels is skipped, never decoded.

    Returns:
        The buffer (possibly empty: callers say what is wrong).
    """
    counter = [0]
    if is_image_folder(data):
        samples = _folder_samples(data, transform, max_image_pixels, counter)
        tokenizer = None
    else:
        decoder = SampleDecoder(transform, tokenizer, image_key.split(";"), text_key, max_pixels=max_image_pixels)
        samples = _shard_samples(data, decoder, counter)
    try:
        rows = list(itertools.islice(samples, limit))
    finally:
        samples.close()
    if not rows:
        return HeldOut(torch.zeros(0), None, counter[0])
    images = torch.stack([r["image"] for r in rows])  # (N, 3, H, W)
    tokens = tokenizer([r["text"] for r in rows]) if tokenizer is not None else None  # (N, L)
    return HeldOut(images, tokens, counter[0])

