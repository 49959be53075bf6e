"""ImageTextDataModule: image-text webdataset shards (img2dataset layout) for every model.

The pipeline reads as a list of named steps, like open_clip's ``get_wds_dataset``: shard list ->
split -> tar expansion -> shuffle -> decode -> transform/tokenise -> batch. Training streams
resampled shards with an explicit epoch length (open_clip's ``--dataset-resampled``), so every rank
yields the same number of batches and DDP never waits on a rank that ran dry.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Optional, Sequence

import braceexpand
import lightning.pytorch as pl
import torch
import webdataset as wds
from torch.utils.data import DataLoader, default_collate

from mmssl.data.demo import demo_data
from mmssl.data.transforms import OPENAI_MEAN, OPENAI_STD, eval_transform, train_transform


def expand_urls(pattern: str) -> list[str]:
    """Expand a shard spec into URLs.

    Args:
        pattern: brace pattern (``data/{00000..00099}.tar``), several joined with ``::``, or a
            folder (every ``*.tar`` inside, sorted).

    Returns:
        The list of shard URLs.
    """
    urls: list[str] = []
    for part in pattern.split("::"):
        if os.path.isdir(part):
            found = sorted(os.path.join(part, f) for f in os.listdir(part) if f.endswith(".tar"))
            if not found:
                raise FileNotFoundError(f"no .tar shards in folder {part!r}")
            urls += found
        else:
            urls += list(braceexpand.braceexpand(part))
    return urls


def count_samples(urls: Sequence[str]) -> Optional[int]:
    """Number of samples from the ``sizes.json`` beside the shards (open_clip's convention).

    Returns:
        The total, or ``None`` if any shard's folder has no ``sizes.json`` entry for it.
    """
    total, cache = 0, {}
    for url in urls:
        folder, name = os.path.split(url)
        if folder not in cache:
            path = os.path.join(folder, "sizes.json")
            cache[folder] = json.load(open(path)) if os.path.exists(path) else {}
        if name not in cache[folder]:
            return None
        total += int(cache[folder][name])
    return total


class ImageTextDataModule(pl.LightningDataModule):
    """Image-text pairs from webdataset shards; the embedded demo set when ``train_data`` is unset.

    Args:
        train_data: training shards (brace pattern, ``::``-joined list, or folder).
        val_data: validation shards; defaults to the demo's held-out split in demo mode.
        batch_size: samples per device per step.
        num_workers: loader worker processes per device.
        train_num_samples: samples per epoch; read from ``sizes.json`` when unset.
        image_size: model input side (linked from the model by the CLI).
        image_mean: normalisation mean (linked from the model).
        image_std: normalisation std (linked from the model).
        tokenizer: text tokenizer (linked from the model); ``None`` yields images only (MAE).
        image_key: sample extensions holding the image, ``;``-separated alternatives.
        text_key: sample extension holding the caption.
        crop_scale: RandomResizedCrop area range for training.
        hflip: random horizontal flip in training.
        shuffle_buffer: samples in the (pre-decode) shuffle buffer.
        seed: seed of shard resampling and shuffling.
        demo_dir: cache folder of the embedded demo data.
    """

    def __init__(
        self,
        train_data: Optional[str] = None,
        val_data: Optional[str] = None,
        batch_size: int = 64,
        num_workers: int = 4,
        train_num_samples: Optional[int] = None,
        image_size: int = 224,
        image_mean: Sequence[float] = OPENAI_MEAN,
        image_std: Sequence[float] = OPENAI_STD,
        tokenizer: Optional[Callable] = None,
        image_key: str = "jpg;jpeg;png;webp",
        text_key: str = "txt",
        crop_scale: tuple[float, float] = (0.9, 1.0),
        hflip: bool = False,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        demo_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.train_data, self.val_data = train_data, val_data
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_num_samples = train_num_samples
        self.image_size, self.image_mean, self.image_std = image_size, image_mean, image_std
        self.tokenizer = tokenizer
        self.image_key, self.text_key = image_key, text_key
        self.crop_scale, self.hflip = crop_scale, hflip
        self.shuffle_buffer, self.seed, self.demo_dir = shuffle_buffer, seed, demo_dir
        self.eval_data: Optional[str] = None  # labelled held-out folder, set in demo mode

    def prepare_data(self) -> None:
        if self.train_data is None:
            demo_data(self.demo_dir)  # generated once per node, before setup on all ranks

    def setup(self, stage: str) -> None:
        if self.train_data is None:
            demo = demo_data(self.demo_dir)
            self.train_data = demo.train
            self.val_data = self.val_data or demo.val
            self.eval_data = demo.eval_dir

    # Pipeline steps -----------------------------------------------------------------------------

    def _to_sample(self, transform: Callable) -> Callable[[dict], dict]:
        return _SampleMaker(transform, self.tokenizer, self.image_key, self.text_key)

    def _world(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def train_dataloader(self) -> DataLoader:
        urls = expand_urls(self.train_data)
        num_samples = self.train_num_samples or count_samples(urls)
        if not num_samples:
            raise ValueError(
                f"data.train_num_samples is unset and no sizes.json lists the shards of "
                f"{self.train_data!r}: set data.train_num_samples to the number of samples per epoch"
            )
        global_batch = self.batch_size * self._world()
        workers = max(1, self.num_workers)
        batches_per_worker = math.ceil(math.ceil(num_samples / global_batch) / workers)
        transform = train_transform(
            self.image_size, self.image_mean, self.image_std, self.crop_scale, self.hflip
        )
        pipeline = wds.DataPipeline(
            # Resampled shards, seeded per (seed, rank, worker, epoch): an endless stream per worker.
            wds.ResampledShards(urls, seed=self.seed, deterministic=True),
            wds.tarfile_to_samples(handler=wds.warn_and_continue),
            wds.shuffle(self.shuffle_buffer),  # shuffle raw bytes, decode late
            wds.decode("pil", handler=wds.warn_and_continue),
            wds.map(self._to_sample(transform), handler=wds.warn_and_continue),
            wds.batched(self.batch_size, partial=False, collation_fn=default_collate),
        ).with_epoch(batches_per_worker)
        return self._loader(pipeline, batches_per_worker * workers, persistent=True)

    def val_dataloader(self) -> Optional[DataLoader]:
        if not self.val_data:
            return []
        transform = eval_transform(self.image_size, self.image_mean, self.image_std)
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(expand_urls(self.val_data)),
            wds.split_by_node,
            wds.split_by_worker,
            wds.tarfile_to_samples(handler=wds.warn_and_continue),
            wds.decode("pil", handler=wds.warn_and_continue),
            wds.map(self._to_sample(transform), handler=wds.warn_and_continue),
            wds.batched(self.batch_size, partial=True, collation_fn=default_collate),
        )
        return self._loader(pipeline, None, persistent=False)

    def _loader(self, pipeline: wds.DataPipeline, length: Optional[int], persistent: bool) -> Any:
        if length is not None:
            pipeline = pipeline.with_length(length, silent=True)  # Lightning's progress bar and LR schedule
        return DataLoader(
            pipeline,
            batch_size=None,  # batched inside the pipeline, per worker
            num_workers=self.num_workers,
            # Persistent workers keep ResampledShards' epoch counter, so each epoch draws anew.
            persistent_workers=persistent and self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )


class _SampleMaker:
    """Decoded webdataset sample -> ``{"image", "text"?, "label"?}`` (a class, so it pickles)."""

    def __init__(self, transform: Callable, tokenizer: Optional[Callable], image_key: str, text_key: str):
        self.transform, self.tokenizer = transform, tokenizer
        self.image_keys = image_key.split(";")
        self.text_key = text_key

    def __call__(self, sample: dict) -> dict:
        image = next((sample[k] for k in self.image_keys if k in sample), None)
        if image is None:
            raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')!r} has no image ({self.image_keys})")
        out = {"image": self.transform(image)}
        if self.tokenizer is not None:
            text = sample.get(self.text_key)
            if not text:
                raise KeyError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')!r} has no caption {self.text_key!r}")
            out["text"] = self.tokenizer([text])[0]
        if "cls" in sample:
            out["label"] = int(sample["cls"])
        return out
