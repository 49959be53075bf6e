"""ImageTextDataModule: image-text (and labelled image) webdataset shards (img2dataset layout) for every model.

The pipeline is built from named steps (open_clip's ``get_wds_dataset``): sources
(:mod:`mmssl.data.sources`) -> split and epoch plan (:func:`~mmssl.data.pipeline.plan_stream`) ->
tar expansion -> shuffle of raw bytes -> late decode and tokenisation in the workers
(:mod:`mmssl.data.decode`) -> batch. The position in the stream is checkpointed
(:mod:`mmssl.data.state`), so a run resumes mid-epoch.

Resume guarantee: a checkpoint written after the model has taken batch ``k`` of an epoch (e.g.
``ModelCheckpoint(every_n_train_steps=...)``, saved at the end of that step) records the topology
(ranks, workers, batch size, shuffle buffer) and, per worker of every rank, the batches served and
the raw samples consumed for them. Resumed with the same shards, seed and topology, each rank
yields exactly the batches ``k+1, k+2, ...`` that the uninterrupted run would have yielded, in the
same order, with the same crops: nothing repeated, nothing skipped. Batches that were prefetched
by the loader but not handed to the model when the checkpoint was written are produced again (they
were never trained on). Resumed on another topology (exact epochs), the epoch is finished
elastically (:mod:`mmssl.data.state`): every sample not yet consumed is read once, none consumed
is read again, and fewer than ``world x batch`` of them are left out (reported).
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from mmssl.data.captions import class_captions
from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS, SampleDecoder, draft_size, trim_text_padding
from mmssl.data.demo import demo_data
from mmssl.data.options import check_data_options
from mmssl.data.pipeline import META_KEYS, ShardStream, StreamSpec, plan_stream
from mmssl.data.sources import DataSpec, count_samples, expand_urls, parse_sources, shard_sizes
from mmssl.data.state import EpochLoader, StreamPosition, run_seed, run_skipped, start_worker_server
from mmssl.data.teacher_embeddings import TeacherEmbeddings, check_shards
from mmssl.data.transforms import (
    OPENAI_MEAN,
    OPENAI_STD,
    BatchNormalize,
    LocalCrops,
    eval_transform,
    timm_eval_transform,
    timm_train_transform,
    train_sample_transform,
)
from mmssl.distributed import is_sharded

__all__ = ["ImageTextDataModule", "count_samples", "expand_urls"]


def validation_batches_per_rank(spec: StreamSpec) -> Optional[list[int]]:
    """Batches each rank's validation stream yields (workers cut their own partial last batch),
    from the shard sizes (``sizes.json`` or counted); ``None`` when some size is unknown."""
    sizes = shard_sizes([u for g in spec.groups for u in g])
    if sizes is None:
        return None
    size_of = dict(zip((u for g in spec.groups for u in g), sizes))
    per_slot = [math.ceil(sum(size_of[u] for u in group) / spec.batch_size) for group in spec.groups]
    return [sum(per_slot[r * spec.workers:(r + 1) * spec.workers]) for r in range(spec.world_size)]


def check_even_validation(spec: StreamSpec, where: str) -> None:
    """Refuse, at start-up, validation shares that FSDP cannot run.

    Under FSDP every forward all-gathers parameters, a collective: a rank with fewer validation
    batches than another stops joining them and the others wait (until the process-group
    timeout). DDP has no such collective in evaluation (see ``EvaluationBufferSync``).
    """
    counts = validation_batches_per_rank(spec)
    if counts is not None and len(set(counts)) > 1:
        raise ValueError(
            f"{where}: under FSDP every validation forward is a collective, so every rank needs the same "
            f"number of validation batches, but the shards give ranks {counts}: use shards of equal size in a "
            f"multiple of ranks x workers ({spec.world_size} x {spec.workers}), or validate on one process")


class GlobalAndLocalCrops:
    """A sample's image transform and its local crops (:class:`~mmssl.data.transforms.LocalCrops`),
    drawn from the sample's RNG in that order; a validation sample (no RNG) draws its crops from a
    fixed seed, so they are the same whichever rank or batch it lands in.

    Args:
        transform: the image transform, PIL image (, rng) -> (3, S, S).
        local: the local crops, PIL image, rng -> (n, 3, S', S') uint8.
    """

    def __init__(self, transform: Callable, local: LocalCrops) -> None:
        self.transform, self.local = transform, local

    def __call__(self, image: Any, rng: Optional[random.Random] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if rng is None:
            return self.transform(image), self.local(image, random.Random(0))
        return self.transform(image, rng), self.local(image, rng)


class LocalCropDecoder(SampleDecoder):
    """:class:`~mmssl.data.decode.SampleDecoder` whose samples also carry ``local_crops``
    (n, 3, S, S), batched as (B, n, 3, S, S) and normalised with ``crop_normalize`` (``None``: left
    uint8, normalised on the device after the transfer). Its ``transform`` is a :class:`GlobalAndLocalCrops`."""

    def __init__(self, *args: Any, crop_normalize: Optional[BatchNormalize] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crop_normalize = crop_normalize

    def output_keys(self, raw: dict[str, Any]) -> set[str]:
        return super().output_keys(raw) | {"local_crops"}

    def __call__(self, raw: dict[str, Any], rng: Optional[random.Random] = None) -> dict[str, Any]:
        out = super().__call__(raw, rng)
        out["image"], out["local_crops"] = out["image"]
        return out

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().collate(samples)  # local_crops stacked: (B, n, 3, S, S)
        if self.crop_normalize is not None:
            batch["local_crops"] = self.crop_normalize(batch["local_crops"])
        return batch


# The loader's length is exact by construction (the plan deals each rank and worker its own
# shards and counts every batch), which is what Lightning's note on IterableDataset lengths warns
# may not hold; it would print on every run, so that one message is silenced.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

class ImageTextDataModule(pl.LightningDataModule):
    """Image-text pairs from webdataset shards; the embedded demo set when ``train_data`` is unset.

    Args:
        train_data: training shards: brace pattern, ``::``-joined specs, folder, URL or ``pipe:``,
            a list of these, or a list of ``{data: SPEC, weight: W}`` to mix sources by weight
            (resampled mode).
        val_data: validation shards, same forms; the demo's held-out split in demo mode.
        batch_size: samples per device per step.
        num_workers: loader worker processes per device.
        resampled: draw shards with replacement (infinite stream, nominal epoch) instead of exact
            epochs; needed when there are fewer shards than ranks x workers, or to weight sources.
        train_num_samples: samples per epoch in resampled mode; read from ``sizes.json`` if unset.
            Exact epochs read what the shards hold, and warn if this says otherwise.
        image_size: model input side (linked from the model by the CLI).
        image_mean: normalisation mean (linked from the model).
        image_std: normalisation std (linked from the model).
        tokenizer: text tokenizer (linked from the model); ``None`` yields images only (MAE).
        image_key: sample extensions holding the image, ``;``-separated alternatives.
        text_key: sample extension holding the caption.
        label_key: sample extension holding an integer class (optional per sample); batches carry
            it as ``label`` in training and validation (what ``ImageClassifier`` trains on).
        crop_scale: RandomResizedCrop area range for training.
        hflip: random horizontal flip in training.
        train_augment: when set, training images go through timm's ``create_transform`` with
            these extra arguments (e.g. ``{auto_augment: rand-m9-mstd0.5-inc1, re_prob: 0.25,
            re_mode: pixel, interpolation: bicubic}``: MAE fine-tuning), after ``crop_scale`` and
            ``hflip``, instead of the plain crop and flip.
        eval_crop_pct: when set, validation images are resized to ``image_size / eval_crop_pct``
            and centre-cropped (timm's eval transform; MAE fine-tuning: 0.875); unset: resized
            to ``image_size`` and centre-cropped.
        shuffle_buffer: raw samples in the (pre-decode) shuffle buffer of each worker.
        seed: seed of shard order, shuffling and crops; streams derive from (seed, epoch, rank, worker).
            Unset: the run's (``seed_everything``, :func:`mmssl.data.state.run_seed`), read at
            setup, and a resumed run keeps the one its checkpoint saved; 0 before setup.
        max_bad_fraction: stop when a worker finds more than this fraction of its samples bad.
        reduced_decode: decode large training JPEGs at reduced size (Pillow ``draft``) when the
            model input is much smaller. Training only: validation decodes in full, as every
            evaluator does (a reduced decode gives other pixels, hence other figures).
        demo_dir: cache folder of the embedded demo data.
        trim_text_padding: cut each batch's tokens after its longest caption, before the transfer
            (set from the model by ``mmssl fit``: on when its text tower ignores padding).
        normalize_on_device: training images leave the workers as uint8 and are normalised after
            the transfer, on the device (a quarter of the bytes through shared memory, pinned
            memory and the host-to-device copy). ``None`` (default): on when the trainer's device
            is not the CPU. The timm chain (``train_augment``) and validation normalise per sample.
        num_classes: labels must lie in ``[0, num_classes)``, else the sample is bad (skipped,
            counted, named); linked from the model by ``mmssl fit`` (a classifier's classes).
            ``None``: any label in int64 >= 0.
        max_image_pixels: an image whose header says more pixels (width x height) is a bad
            sample, never decoded (default: PIL's decompression-bomb threshold, 89.5 Mpx);
            ``None``: no limit of mmssl's.
        teacher_tokenizer: a distillation teacher's tokenizer when it differs from ``tokenizer``
            (linked from the model): training captions are tokenised by both.
        teacher_embeddings: folder of stored teacher embeddings (``tools/teacher_embeddings.py``;
            linked from the model) joined to training samples by key; a sample without them is bad.
        captions_from_classes: FLYP (Goyal et al. 2022): captions made from each sample's class
            label and a prompt template drawn per sample, instead of the shards' ``text_key``:
            a class-names file (one name a line, in label order) or a labelled set holding
            ``classnames.txt`` (:mod:`mmssl.data.captions`). A sample without a label, or with a
            label beyond the names, is a bad sample.
        caption_templates: the templates file of ``captions_from_classes`` (one prompt a line,
            with ``{c}``); unset: ``zeroshot_classification_templates.txt`` beside the class
            names, else CLIP's 80 ImageNet prompts.
        local_crops: random-resized local crops per image, batched as ``local_crops`` (B, n, 3, S,
            S) at the model's input size, for self-distillation (SILC / DINO's local views; read by
            :mod:`mmssl.objectives.self_distill`); drawn from each sample's RNG after its crop, so
            seeded and resumed like it. Validation crops come from a fixed seed. 0: none.
        local_crop_scale: area range of the local crops (DINO: (0.05, 0.4)).
    """

    def __init__(
        self,
        train_data: Optional[DataSpec] = None,
        val_data: Optional[DataSpec] = None,
        batch_size: int = 64,
        num_workers: int = 4,
        resampled: bool = False,
        train_num_samples: Optional[int] = None,
        image_size: int = 224,
        image_mean: Sequence[float] = OPENAI_MEAN,
        image_std: Sequence[float] = OPENAI_STD,
        tokenizer: Optional[Callable] = None,
        image_key: str = "jpg;jpeg;png;webp",
        text_key: str = "txt",
        label_key: str = "cls",
        crop_scale: tuple[float, float] = (0.9, 1.0),
        hflip: bool = False,
        train_augment: Optional[dict[str, Any]] = None,
        eval_crop_pct: Optional[float] = None,
        shuffle_buffer: int = 1000,
        seed: Optional[int] = None,
        max_bad_fraction: float = 0.1,
        reduced_decode: bool = True,
        demo_dir: Optional[str] = None,
        trim_text_padding: bool = False,
        normalize_on_device: Optional[bool] = None,
        num_classes: Optional[int] = None,
        max_image_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS,
        teacher_tokenizer: Optional[Callable] = None,
        teacher_embeddings: Optional[str] = None,
        captions_from_classes: Optional[str] = None,
        caption_templates: Optional[str] = None,
        local_crops: int = 0,
        local_crop_scale: tuple[float, float] = (0.05, 0.4),
    ) -> None:
        super().__init__()
        if isinstance(local_crops, bool) or not isinstance(local_crops, int) or local_crops < 0:
            raise ValueError(f"data.init_args.local_crops must be an integer >= 0, got {local_crops!r}")
        if local_crops and train_augment is not None:
            raise ValueError("data.init_args.local_crops: local crops are drawn beside the plain crop, not timm's "
                             "chain (data.init_args.train_augment); set one of them")
        if local_crops and not (len(local_crop_scale) == 2 and 0.0 < local_crop_scale[0] <= local_crop_scale[1] <= 1.0):
            raise ValueError(f"data.init_args.local_crop_scale must be [min, max] with 0 < min <= max <= 1, "
                             f"got {local_crop_scale!r}")
        self.local_crops, self.local_crop_scale = local_crops, tuple(local_crop_scale)
        if caption_templates and not captions_from_classes:
            raise ValueError("data.init_args.caption_templates is set without data.init_args.captions_from_classes: "
                             "the templates make captions from class names; name the class-names file too")
        # Read now, so a missing or bad class-names file stops the run before any data is read; in
        # demo mode in setup, once the demo set (and its classnames.txt) is written.
        self._caption_files = (captions_from_classes, caption_templates)
        self.captions = None
        if captions_from_classes and train_data is not None:
            self.captions = class_captions(captions_from_classes, caption_templates)
        check_data_options(batch_size, num_workers, max_bad_fraction, shuffle_buffer, image_size, train_num_samples,
                           crop_scale, eval_crop_pct, image_mean, image_std,
                           dict(image_key=image_key, text_key=text_key, label_key=label_key))
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"data.init_args.num_classes must be >= 1 or null, got {num_classes}")
        if max_image_pixels is not None and max_image_pixels < 1:
            raise ValueError(f"data.init_args.max_image_pixels must be >= 1 or null, got {max_image_pixels}")
        self.num_classes, self.max_image_pixels = num_classes, max_image_pixels
        self.train_data, self.val_data = train_data, val_data
        self.batch_size, self.num_workers = batch_size, num_workers
        self.resampled, self.train_num_samples = resampled, train_num_samples
        self.image_size, self.image_mean, self.image_std = image_size, image_mean, image_std
        self.tokenizer, self.trim_text_padding = tokenizer, trim_text_padding
        self.normalize_on_device = normalize_on_device
        self.image_key, self.text_key, self.label_key = image_key, text_key, label_key
        self.crop_scale, self.hflip = crop_scale, hflip
        self.train_augment, self.eval_crop_pct = train_augment, eval_crop_pct
        self.shuffle_buffer, self.seed, self._seed_follows_run = shuffle_buffer, seed or 0, seed is None
        self.max_bad_fraction, self.reduced_decode, self.demo_dir = max_bad_fraction, reduced_decode, demo_dir
        self.eval_data: Optional[str] = None  # labelled held-out folder, set in demo mode
        self.position = StreamPosition()
        self._device_normalize: Optional[BatchNormalize] = None
        self._loaded: Optional[dict[str, Any]] = None  # a checkpoint's position, applied with the stream
        self._reload_setting: Optional[int] = None  # the trainer's, while an elastic epoch makes it reload
        self.teacher_tokenizer = teacher_tokenizer
        # The manifest is read (and refused, naming it) here, at start-up.
        self.teacher_embeddings = TeacherEmbeddings(teacher_embeddings) if teacher_embeddings else None

    def prepare_data(self) -> None:
        if self.train_data is None:
            demo_data(self.demo_dir)  # generated once per node, before setup on all ranks

    def setup(self, stage: str) -> None:
        if self.num_workers > 0:
            # Its imports run beside the model's build (mmssl.data.state.worker_context).
            start_worker_server(self.tokenizer, self.teacher_tokenizer, self.captions)
        if self._seed_follows_run:  # before a checkpoint's seed is loaded (Lightning restores after setup)
            self.seed = run_seed(self.trainer)
        if self.train_data is None:
            demo = demo_data(self.demo_dir)
            self.train_data = demo.train
            self.val_data = self.val_data or demo.val
            self.eval_data = demo.eval_dir
            if self._caption_files[0] and self.captions is None:
                self.captions = class_captions(*self._caption_files)
        if stage == "fit":
            # Plan the streams now: setup runs before the model is moved to its device, so a
            # missing shard, an empty folder or too few shards for ranks x workers fails here,
            # before any accelerator time is spent. The loaders plan theirs again (train_dataloader).
            rank, world = self._rank_world()
            for key, data, train in (("train_data", self.train_data, True), ("val_data", self.val_data, False)):
                if data:
                    try:
                        stream = self.build_stream(data, train, rank, world)
                    except (ValueError, FileNotFoundError) as err:
                        # Not ``type(err)``: some subclasses (json's JSONDecodeError) take other arguments.
                        cls = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
                        raise cls(f"data.{key}={data!r}: {err}") from err
                    if train:
                        self._report(stream)
                        if self.teacher_embeddings is not None:
                            check_shards(self.teacher_embeddings.folder, stream.spec.urls)
                    elif world > 1 and is_sharded(self.trainer.strategy) and not getattr(
                            self.trainer.strategy, "gather_for_evaluation", False):
                        check_even_validation(stream.spec, f"data.{key}={data!r}")

    def _report(self, stream: ShardStream) -> None:
        """Log the training epoch's plan once (rank 0): samples, left out, duplicates, batches."""
        spec = stream.spec
        topology = f"{spec.world_size} ranks x {spec.workers} workers x batch {spec.batch_size}"
        if not spec.exact:
            rank_zero_info(f"data: resampled stream over {topology}: {spec.rank_batches} batches per rank "
                           f"per nominal epoch, shards drawn with replacement")
            return
        total = sum(spec.sizes)
        used = spec.rank_batches * spec.world_size * spec.batch_size
        if self.train_num_samples is not None and self.train_num_samples != total:
            rank_zero_warn(f"data.train_num_samples={self.train_num_samples} applies to resampled mode: exact epochs "
                           f"read the {total} samples the shards hold")
        rank_zero_info(f"data: exact epochs over {topology}: {total} samples, {used} read per epoch in "
                       f"{spec.rank_batches} batches per rank, {total - used} left out, 0 duplicates; "
                       f"shards re-dealt every epoch")

    # Pipeline -----------------------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _decoder(self, train: bool) -> SampleDecoder:
        batch_transform = None
        if train and self.train_augment is not None:  # timm's chain, normalised per sample
            transform = timm_train_transform(self.image_size, self.image_mean, self.image_std, self.crop_scale,
                                             self.hflip, self.train_augment)
        elif train:  # uint8 crops per sample, normalised once per batch (mmssl.data.transforms)
            transform = train_sample_transform(self.image_size, self.crop_scale, self.hflip)
            if not self._normalizes_on_device():  # else in on_after_batch_transfer
                batch_transform = BatchNormalize(self.image_mean, self.image_std)
        elif self.eval_crop_pct is not None:
            transform = timm_eval_transform(self.image_size, self.image_mean, self.image_std, self.eval_crop_pct)
        else:
            transform = eval_transform(self.image_size, self.image_mean, self.image_std)
        min_size = draft_size(self.image_size, self.crop_scale[0]) if self.reduced_decode and train else None
        teacher = (self.teacher_tokenizer, self.teacher_embeddings) if train else (None, None)  # training only
        args = (self.tokenizer, self.image_key.split(";"), self.text_key, self.label_key, min_size, batch_transform,
                self.num_classes, self.max_image_pixels, *teacher)
        if not self.local_crops:
            return SampleDecoder(transform, *args, captions=self.captions)
        if min_size is not None:  # the smallest local crop, at full resolution too
            args = (*args[:4], max(min_size, draft_size(self.image_size, self.local_crop_scale[0])), *args[5:])
        local = LocalCrops(self.local_crops, self.image_size, self.local_crop_scale, self.hflip)
        normalize = None if self._normalizes_on_device() else BatchNormalize(self.image_mean, self.image_std)
        return LocalCropDecoder(GlobalAndLocalCrops(transform, local), *args, captions=self.captions,
                                crop_normalize=normalize)

    def build_stream(self, data: DataSpec, train: bool, rank: int = 0, world_size: int = 1) -> ShardStream:
        """The dataset of one rank (tests pass ``rank``/``world_size`` to simulate ranks).

        Args:
            data: shard spec (``train_data`` or ``val_data``).
            train: training stream (shuffled, equal length on every rank) or validation.
            rank: global rank.
            world_size: number of processes.

        Returns:
            The :class:`ShardStream`.
        """
        spec = plan_stream(
            parse_sources(data), self.batch_size, rank, world_size, max(1, self.num_workers),
            resampled=self.resampled and train, train=train, num_samples=self.train_num_samples,
            seed=self.seed, shuffle_buffer=self.shuffle_buffer, max_bad_fraction=self.max_bad_fraction,
        )
        return ShardStream(spec, self._decoder(train))

    def _normalizes_on_device(self) -> bool:
        if self.normalize_on_device is not None:
            return self.normalize_on_device
        return self.trainer is not None and self.trainer.strategy.root_device.type != "cpu"

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Normalise uint8 training images on the device they were moved to (``normalize_on_device``)."""
        for key in ("image", "local_crops"):
            if isinstance(batch, dict) and isinstance(batch.get(key), torch.Tensor) and batch[key].dtype == torch.uint8:
                if self._device_normalize is None:
                    self._device_normalize = BatchNormalize(self.image_mean, self.image_std)
                batch[key] = self._device_normalize(batch[key])
        return batch

    def _current_epoch(self) -> Optional[int]:
        return self.trainer.current_epoch if self.trainer is not None else None

    def train_dataloader(self) -> EpochLoader:
        # The stream is planned here again, not kept from setup's check: a resumed run's seed is
        # restored after setup (load_state_dict), and the plan deals the shards by the seed. A plan
        # takes well under a second (benchmarks/plan_speed.py, a LAION-sized layout).
        rank, world = self._rank_world()
        stream = self.build_stream(self.train_data, True, rank, world)
        if self._loaded is not None:
            self.position.load_state_dict(self._loaded, stream.spec)
            self._loaded = None
        loader = EpochLoader(stream, self._current_epoch, self.position, num_workers=self.num_workers,
                             pin_memory=torch.cuda.is_available())
        trainer = self.trainer
        if trainer is not None:
            # An elastic resume gives the resumed epoch its own length, and the trainer reads a
            # loader's length only when it loads it: reload for the next epoch, whose length is whole.
            if len(loader) != stream.spec.rank_batches and not trainer.reload_dataloaders_every_n_epochs:
                self._reload_setting = trainer.reload_dataloaders_every_n_epochs
                trainer.reload_dataloaders_every_n_epochs = 1
            elif len(loader) == stream.spec.rank_batches and self._reload_setting is not None:
                trainer.reload_dataloaders_every_n_epochs, self._reload_setting = self._reload_setting, None
        return loader

    def val_dataloader(self) -> Union[EpochLoader, list]:
        if not self.val_data:
            return []
        rank, world = self._rank_world()
        stream = self.build_stream(self.val_data, False, rank, world)
        return EpochLoader(stream, num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    # Position, counts and checkpoint ------------------------------------------------------------

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Strip the stream metadata; in training, advance the position and log ``data/skipped``.

        With ``trim_text_padding``, also cut the tokens after the batch's longest caption (here, on
        the CPU, so finding the length never waits for an accelerator). ``CLIP.encode_text`` trims
        tokens still on the CPU, for its other callers (zero-shot prompts, tools); it cannot trim
        these batches once they are on an accelerator, hence the trim here too."""
        if not isinstance(batch, dict) or "__worker__" not in batch:
            return batch
        if self.trim_text_padding and "text" in batch:
            batch["text"] = trim_text_padding(batch["text"])
        worker, raw, skipped = (int(batch.pop(k)) for k in META_KEYS)
        trainer = self.trainer
        # Without a trainer (tests, tools), a started training position tells a training batch.
        if (trainer.training if trainer is not None else bool(self.position.batches)):
            self.position.update(worker, raw, skipped)
            if trainer is not None:
                self._log_skipped(trainer)
        return batch

    def _log_skipped(self, trainer: pl.Trainer) -> None:
        # Every rank reaches the same batch count in lockstep, so the reduction is safe here; the
        # Lightning module's `log` is not allowed in batch-transfer hooks, so write to the loggers.
        if sum(self.position.batches) % max(1, trainer.log_every_n_steps) != 0:
            return
        total = torch.tensor(float(self.position.skipped))
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(total.to(trainer.strategy.root_device), reduce_op="sum").cpu()
        for logger in trainer.loggers:
            logger.log_metrics({"data/skipped": float(total)}, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position (see the module docstring for the resume guarantee).

        ``{"position": {"epoch", "batches": [per worker], "raw": [[per worker] per rank], "skipped",
        "topology": {world, workers, batch, buffer}, "offset", "samples", "history"}, "seed"}``.
        """
        if self._loaded is not None:  # restored but not yet applied (no training loader built)
            return {"position": self._loaded, "seed": self.seed}
        trainer = self.trainer
        raw_per_rank, skipped = None, None
        if trainer is not None and trainer.world_size > 1:
            # Called on every rank while the checkpoint is dumped; each rank's workers consumed
            # different raw counts and skipped different samples, so gather them all (rank 0
            # writes the file): the raw counts per rank, the skipped ones as the run's total.
            local = torch.tensor([*self.position.raw, self.position.skipped], device=trainer.strategy.root_device)
            gathered = trainer.strategy.all_gather(local).cpu()
            raw_per_rank, skipped = gathered[:, :-1].tolist(), int(gathered[:, -1].sum())
        return {"position": self.position.state_dict(raw_per_rank, skipped), "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict`; applied when the training loader is built."""
        if self._seed_follows_run:  # the stream the checkpoint was taken from continues
            self.seed = int(state_dict.get("seed", self.seed))
        if state_dict.get("seed", self.seed) != self.seed:
            rank_zero_warn(f"the data position was saved with data.seed={state_dict['seed']}, this run has "
                           f"data.seed={self.seed}: the data stream restarts epoch "
                           f"{state_dict['position'].get('epoch')} from its beginning")
            self.position.skipped = run_skipped(state_dict["position"], self._rank_world()[0])
            return
        self._loaded = state_dict["position"]
