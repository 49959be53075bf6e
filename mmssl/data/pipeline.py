"""The shard stream: what each (rank, worker) slot reads, in what order, and how batches are cut.

One worker's stream is a pure function of (spec, epoch plan, rank, worker), read as a list of
steps like open_clip's ``get_wds_dataset``: the slot's pieces of shards -> tar expansion
(webdataset's ``tarfile_samples``, so URLs and ``pipe:`` work) -> shuffle of raw bytes -> late
decode (bad samples skipped and counted; augmentation drawn per sample) -> batch. Two modes:

- **exact epochs** (default): :mod:`mmssl.data.plan` deals the epoch's samples to slots from
  (seed, epoch) at sample granularity, using ``sizes.json``: every rank gets the same number of
  batches, each sample is read at most once, fewer than ``world x batch`` are left out. A slot's
  range may start inside a shard: a local tar is entered there by seeking (headers scanned), other
  URLs are read from the start with the samples before the range dropped undecoded.
  Each piece is checked against ``sizes.json`` as it is read: planned samples a shard does not give
  (it vanished, became unreadable, holds fewer) and samples it holds beyond its listed size are bad
  samples, named and counted toward ``max_bad_fraction``. Only when bad samples leave a worker
  short does it fill its last batches from a second pass over its own samples (warned, with the
  count of bad or missing samples).
- **resampled** (open_clip's ``--dataset-resampled``): each worker draws shards with replacement
  (weighted across sources) forever; the nominal epoch is ``num_samples`` samples.

Every sample's augmentation draws from a ``random.Random`` seeded by (seed, epoch, shard, key), so a
sample gets the same crop whichever slot reads it and whether or not the run was resumed.

Every batch carries three small Python integers, ``__worker__``, ``__raw__`` (raw samples the
worker has consumed this epoch) and ``__skipped__`` (samples skipped since its previous batch);
:class:`~mmssl.data.datamodule.ImageTextDataModule` strips them before the model sees the batch.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from mmssl.data.decode import BadSample, SampleDecoder
from mmssl.data.plan import EpochPlan, Generation, Piece, ReservoirDraws, Topology, epoch_base, slot_seed, split_base
from mmssl.data.reading import Health, read_pieces, read_shards
from mmssl.data.sources import Source, shard_sizes, sizes_origin

log = logging.getLogger("mmssl.data")

META_KEYS = ("__worker__", "__raw__", "__skipped__")
# Resampled mode gives up after this many shard draws in a row that yield no sample.
MAX_EMPTY_DRAWS = 50


@dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to produce its stream (picklable; no rank lookups inside).

    Attributes:
        sources: the shard sources (weights apply in resampled mode).
        batch_size: samples per batch.
        rank: global rank of this process (node rank x devices + local rank).
        world_size: number of processes.
        workers: loader workers per process (1 when ``num_workers=0``).
        resampled: resampled mode instead of exact epochs.
        train: training stream (shuffled, full batches, equal length on every rank); else one
            ordered pass with a partial last batch (validation).
        rank_batches: batches per rank in a fresh epoch (training).
        sizes: exact training, samples per shard (one per URL of ``urls``).
        groups: validation, shard URLs of each (rank, worker) slot, ``rank * workers + worker``.
        seed: base seed of shard order, shuffling and augmentation.
        shuffle_buffer: raw samples held in the shuffle buffer.
        max_bad_fraction: stop when more than this fraction of a worker's samples is bad.
    """

    sources: tuple[Source, ...]
    batch_size: int
    rank: int = 0
    world_size: int = 1
    workers: int = 1
    resampled: bool = False
    train: bool = True
    rank_batches: Optional[int] = None
    sizes: tuple[int, ...] = ()
    groups: tuple[tuple[str, ...], ...] = ()
    seed: int = 0
    shuffle_buffer: int = 1000
    max_bad_fraction: float = 0.1

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(u for s in self.sources for u in s.urls)

    @property
    def exact(self) -> bool:
        """Exact-epoch training (planned by :mod:`mmssl.data.plan`)."""
        return self.train and not self.resampled

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.workers, self.batch_size, self.shuffle_buffer)

    def plan(self, epoch: int, history: Sequence[Generation] = ()) -> EpochPlan:
        """The exact-epoch plan of ``epoch`` on this topology, after the elastic resumes in ``history``."""
        return split_base(epoch_base(self.sizes, self.seed, epoch, history), self.topology)


def plan_stream(
    sources: Sequence[Source],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    workers: int = 1,
    resampled: bool = False,
    train: bool = True,
    num_samples: Optional[int] = None,
    sizes: Optional[Sequence[int]] = None,
    **kwargs: Any,
) -> StreamSpec:
    """Decide the split and the epoch length for one rank.

    Args:
        sources: shard sources.
        batch_size: samples per batch.
        rank: global rank.
        world_size: number of processes.
        workers: loader workers per process (``max(1, num_workers)``).
        resampled: resampled mode.
        train: training stream (see :class:`StreamSpec`).
        num_samples: samples per epoch (resampled mode); from ``sizes.json`` when unset.
        sizes: samples per shard; read from ``sizes.json`` (or counted, local shards) when unset.
        **kwargs: ``seed``, ``shuffle_buffer``, ``max_bad_fraction``.

    Returns:
        The spec of this rank's stream.

    Raises:
        ValueError: weights in exact mode, an epoch too small for one global batch, or an epoch
            length that cannot be known.
    """
    slots = world_size * workers
    urls = [u for s in sources for u in s.urls]
    common = dict(sources=tuple(sources), batch_size=batch_size, rank=rank, world_size=world_size,
                  workers=workers, resampled=resampled, train=train, **kwargs)
    if not train:
        # Validation: one ordered pass, nothing padded or dropped. Shards are dealt round-robin
        # over ranks first (``urls[rank::world]``), then over that rank's workers, so ranks get
        # shard counts within one of each other (rank-major dealing left whole ranks empty).
        groups = [urls[r::world_size][w::workers] for r in range(world_size) for w in range(workers)]
        return StreamSpec(groups=tuple(map(tuple, groups)), **common)
    if resampled:
        sizes = None if num_samples else (sizes or shard_sizes(urls))
        if not num_samples and not sizes:
            raise ValueError("resampled mode needs the epoch length: set data.train_num_samples "
                             "(no sizes.json lists the shards)")
        total = num_samples or sum(sizes)
        return StreamSpec(rank_batches=workers * max(1, math.ceil(total / (slots * batch_size))), **common)
    if any(s.weight != 1.0 for s in sources):
        raise ValueError("weighted sources need data.resampled=true: an exact epoch reads every "
                         "sample once, so it cannot weight one source over another")
    sizes = list(sizes) if sizes is not None else shard_sizes(urls)
    if sizes is None:
        raise ValueError("exact epochs need the samples per shard: add a sizes.json beside the "
                         "shards (tools/make_shards.py writes one) or set data.resampled=true")
    rank_batches = sum(sizes) // (world_size * batch_size)
    if rank_batches == 0:
        raise ValueError(
            f"{sum(sizes)} samples cannot fill one global batch of ranks x batch_size = {world_size} x "
            f"{batch_size} (samples {sizes_origin(urls)}): lower data.batch_size, or set data.resampled=true (with "
            "data.train_num_samples); if a sizes.json lists fewer samples than its shards hold, correct it "
            "(tools/inspect_shards.py counts them)")
    return StreamSpec(sizes=tuple(sizes), rank_batches=rank_batches, **common)


def _resampled_urls(sources: Sequence[Source], rng: random.Random) -> Iterator[str]:
    weights = [s.weight for s in sources]
    while True:
        source = rng.choices(sources, weights=weights)[0] if len(sources) > 1 else sources[0]
        yield rng.choice(source.urls)


def _slot_raw(spec: StreamSpec, pieces: Sequence[Piece], seed: str, health: Health) -> Iterator[dict]:
    """A slot's shuffled raw samples; further passes only if bad input left it short of batches.

    The first pass checks every piece against ``spec.sizes`` (:func:`~mmssl.data.reading.read_pieces`:
    what a shard lacks or holds beyond its listed size is counted bad); a further pass repeats samples
    and says so, with how many of the slot's planned samples were bad or missing.
    """
    urls, passes, planned = spec.urls, 0, sum(len(p) for p in pieces)
    while True:
        before = health.raw
        draws = ReservoirDraws(seed if not passes else f"{seed}/pass{passes}", spec.shuffle_buffer)
        yield from draws.shuffle(read_pieces(urls, pieces, health, spec.sizes if not passes else None))
        shards = sorted({urls[p.shard] for p in pieces})
        if health.raw == before:
            raise RuntimeError(f"no sample could be read from shards {shards[:5]}"
                               f"{' ...' if len(shards) > 5 else ''}; problems: {health.errors[-3:]}")
        if not passes:
            health.check(final=True)  # every planned sample met: the fraction is final
        passes += 1
        log.warning(f"{health.bad} of the {planned} samples planned for this worker this epoch were bad or missing "
                    f"(named above), within data.max_bad_fraction={spec.max_bad_fraction}: it repeats samples of "
                    f"shards {shards[:3]}{' ...' if len(shards) > 3 else ''} to fill its last batches (pass "
                    f"{passes + 1} over them)")


def raw_stream(spec: StreamSpec, epoch: int, worker: int, health: Health, plan: Optional[EpochPlan] = None,
               generation: int = 0) -> Iterator[dict]:
    """The shuffled raw samples of one worker in one epoch (deterministic)."""
    if spec.exact:
        slot = spec.rank * spec.workers + worker
        plan = plan or spec.plan(epoch)
        yield from _slot_raw(spec, plan.slots[slot], slot_seed(spec.seed, epoch, generation, slot), health)
        return
    if spec.resampled:
        # Seeded from (seed, epoch, rank, worker); str seeds hash with SHA-512, stable across runs.
        rng = random.Random(f"{spec.seed}/{epoch}/{spec.rank}/{worker}")
        draws = ReservoirDraws(f"{spec.seed}/{epoch}/{spec.rank}/{worker}", spec.shuffle_buffer)
        yield from draws.shuffle(read_shards(_resampled_urls(spec.sources, rng), health, MAX_EMPTY_DRAWS))
        return
    slot = spec.rank * spec.workers + worker
    yield from read_shards(iter(spec.groups[slot] if slot < len(spec.groups) else ()), health, None)


def augmentation_rng(seed: int, epoch: int, sample: dict) -> random.Random:
    """The RNG of one sample's augmentation: a function of (seed, epoch, shard file name, key)."""
    return random.Random(f"{seed}/{epoch}/{os.path.basename(str(sample.get('__url__')))}/{sample.get('__key__')}")


def collate(
    samples: list[dict], worker: int, raw: int, skipped: int, decoder: SampleDecoder
) -> dict[str, torch.Tensor]:
    """Stack samples with the decoder's :meth:`~SampleDecoder.collate` and attach the stream metadata."""
    batch = decoder.collate(samples)
    # Plain ints, not tensors: each tensor in a batch crosses from the worker through its own
    # shared-memory segment, set up and mapped again for every batch.
    batch.update(__worker__=worker, __raw__=raw, __skipped__=skipped)
    return batch


def worker_batches(
    spec: StreamSpec,
    decoder: SampleDecoder,
    epoch: int,
    worker: int,
    done: int = 0,
    skip: int = 0,
    plan: Optional[EpochPlan] = None,
    generation: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of one worker in one epoch.

    A sample that lacks a key the worker's stream has carried this epoch (say, a label) is skipped
    as bad, so a batch never loses a key; samples held in the open batch when a key first appears
    are skipped then.

    Args:
        spec: the stream spec.
        decoder: raw sample -> model inputs.
        epoch: epoch number (seeds).
        worker: worker index within the rank.
        done: batches this worker already served this epoch (resume).
        skip: raw samples this worker already consumed this epoch (resume; skipped undecoded).
        plan: exact training, the epoch's plan (default: the fresh plan of ``epoch``).
        generation: elastic resumes before ``plan`` in this epoch (seeds its shuffle buffers).

    Returns:
        An iterator over this worker's remaining batches.
    """
    health = Health(spec.max_bad_fraction)
    health.muted = skip > 0
    if spec.exact:
        plan = plan or spec.plan(epoch)
        limit: Optional[int] = plan.worker_batches[worker] - done
    else:
        limit = None if spec.rank_batches is None else spec.rank_batches // spec.workers - done
    if limit is not None and limit <= 0:
        return
    batch: list[tuple[dict, dict]] = []  # (raw sample, decoded)
    keys: set[str] = set()  # every key the stream carried so far (read from raw samples, so resume-safe)
    position = 0
    for position, sample in enumerate(raw_stream(spec, epoch, worker, health, plan, generation), start=1):
        carried = decoder.output_keys(sample)
        if not carried <= keys:  # a new key (say, the first label): drop what lacks it
            keys |= carried
            for raw, out in batch:
                if out.keys() != keys:
                    health.seen -= 1  # counted again as bad
                    health.sample_failed(raw, f"lacks {sorted(keys - out.keys())}, which its stream carries")
            batch = [(raw, out) for raw, out in batch if out.keys() == keys]
        if position <= skip:
            continue
        health.muted = False
        try:
            out = decoder(sample, augmentation_rng(spec.seed, epoch, sample)) if spec.train else decoder(sample)
            if out.keys() != keys:
                raise BadSample(f"lacks {sorted(keys - out.keys())}, which its stream carries")
            batch.append((sample, out))
            health.seen += 1
        except BadSample as exn:
            health.sample_failed(sample, str(exn))
        if len(batch) == spec.batch_size:
            if spec.exact and limit == 1:
                health.check(final=True)  # before the worker's last batch: the run stops in this epoch
            yield collate([out for _, out in batch], worker, position, health.take_pending(), decoder)
            batch = []
            if limit is not None:
                limit -= 1
                if limit == 0:
                    return
    if batch and not spec.train:
        yield collate([out for _, out in batch], worker, position, health.take_pending(), decoder)


@dataclass(frozen=True)
class EpochRun:
    """What the workers of one rank read in one epoch, set before they start.

    Attributes:
        epoch: the epoch.
        plan: exact training, its plan on this topology.
        generation: elastic resumes inside this epoch before ``plan``.
        offset: batches each rank served this epoch in earlier generations (elastic resume).
        rotation: the worker whose batch comes next; the loader's round-robin starts at its
            worker 0, so worker ``p`` plays worker ``(p + rotation) % workers``.
        resume: worker -> (batches served, raw samples consumed) in this generation.
    """

    epoch: int
    plan: Optional[EpochPlan] = None
    generation: int = 0
    offset: int = 0
    rotation: int = 0
    resume: dict[int, tuple[int, int]] = field(default_factory=dict)

    def length(self, spec: StreamSpec) -> int:
        """Batches of the whole epoch on this rank, those of earlier generations included."""
        return self.offset + (self.plan.rank_batches if self.plan is not None else spec.rank_batches or 0)


class ShardStream(IterableDataset):
    """The per-rank dataset the loader iterates; each worker runs :func:`worker_batches`.

    Args:
        spec: from :func:`plan_stream`.
        decoder: raw sample -> model inputs.
    """

    def __init__(self, spec: StreamSpec, decoder: SampleDecoder) -> None:
        self.spec, self.decoder = spec, decoder
        self.run = EpochRun(0)

    def set_run(self, run: EpochRun) -> None:
        """Set before workers start: the epoch, its plan and, for a resume, where each worker stands."""
        self.run = run

    def __len__(self) -> int:
        if self.spec.rank_batches is None:
            raise TypeError("a validation stream has no length")
        return self.run.length(self.spec)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        physical, count = (info.id, info.num_workers) if info is not None else (0, 1)
        if count != self.spec.workers:
            raise RuntimeError(f"stream planned for {self.spec.workers} workers runs in {count}")
        run = self.run
        worker = (physical + run.rotation) % count
        done, skip = run.resume.get(worker, (0, 0))
        return worker_batches(self.spec, self.decoder, run.epoch, worker, done, skip, run.plan, run.generation)
