"""The shard stream: which worker reads which shards, in what order, and how batches are cut.

One worker's stream is a pure function of (spec, epoch, rank, worker), read as a list of steps
like open_clip's ``get_wds_dataset``: shard order -> tar expansion (webdataset's
``tarfile_samples``, so URLs and ``pipe:`` work) -> shuffle of raw bytes -> late decode (bad
samples skipped and counted) -> batch. Two modes:

- **exact epochs** (default): shards are split across ranks and workers into fixed groups
  balanced by sample count (greedy largest-first, using ``sizes.json``); every worker yields the
  same number of batches, ``ceil(largest group / batch_size)``, so every rank yields the same
  number of batches and DDP never hangs. A worker whose group runs out first tops up from a second
  pass over its own shards. Each sample is served once per epoch; only these top-up batches repeat.
- **resampled** (open_clip's ``--dataset-resampled``): each worker draws shards with replacement
  (weighted across sources) forever; the nominal epoch is ``num_samples`` samples.

Every batch carries three small Python integers, ``__worker__``, ``__raw__`` (raw samples the
worker has consumed this epoch) and ``__skipped__`` (samples skipped since its previous batch);
:class:`~mmssl.data.webdataset.ImageTextDataModule` strips them before the model sees the batch.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from mmssl.data.decode import BadSample, SampleDecoder
from mmssl.data.sources import Source, shard_sizes

log = logging.getLogger("mmssl.data")

META_KEYS = ("__worker__", "__raw__", "__skipped__")
# Judge the bad fraction only once a worker has seen this many samples, so that one bad sample
# among the first few does not stop a run.
MIN_SEEN_FOR_FRACTION = 64
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
        train: training stream (shuffled, full batches, fixed length); else one ordered pass with
            a partial last batch (validation).
        num_batches: batches per worker per epoch (training).
        groups: exact mode, shard URLs of each (rank, worker) slot, ``rank * workers + worker``.
        seed: base seed of shard order and shuffling.
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
    num_batches: Optional[int] = None
    groups: tuple[tuple[str, ...], ...] = ()
    seed: int = 0
    shuffle_buffer: int = 1000
    max_bad_fraction: float = 0.1


def balance_shards(urls: Sequence[str], sizes: Sequence[int], slots: int) -> list[list[str]]:
    """Split shards into ``slots`` groups of near-equal sample count (largest first to the lightest).

    Args:
        urls: shard URLs.
        sizes: samples per shard.
        slots: number of groups (ranks x workers).

    Returns:
        The groups, each in the input order of its shards.
    """
    groups: list[list[int]] = [[] for _ in range(slots)]
    totals = [0] * slots
    for i in sorted(range(len(urls)), key=lambda i: (-sizes[i], i)):
        slot = min(range(slots), key=lambda s: (totals[s], s))
        groups[slot].append(i)
        totals[slot] += sizes[i]
    return [[urls[i] for i in sorted(group)] for group in groups]


def plan_stream(
    sources: Sequence[Source],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    workers: int = 1,
    resampled: bool = False,
    train: bool = True,
    num_samples: Optional[int] = None,
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
        **kwargs: ``seed``, ``shuffle_buffer``, ``max_bad_fraction``.

    Returns:
        The spec of this rank's stream.

    Raises:
        ValueError: exact mode with fewer shards than ranks x workers, weights in exact mode, or
            an epoch length that cannot be known.
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
        sizes = None if num_samples else shard_sizes(urls)
        if not num_samples and not sizes:
            raise ValueError("resampled mode needs the epoch length: set data.train_num_samples "
                             "(no sizes.json lists the shards)")
        total = num_samples or sum(sizes)
        return StreamSpec(num_batches=max(1, math.ceil(total / (slots * batch_size))), **common)
    if any(s.weight != 1.0 for s in sources):
        raise ValueError("weighted sources need data.resampled=true: an exact epoch reads every "
                         "sample once, so it cannot weight one source over another")
    if len(urls) < slots:
        raise ValueError(
            f"exact epochs split shards across ranks x workers = {world_size} x {workers} = {slots} "
            f"readers, but there are only {len(urls)} shards: set data.resampled=true (with "
            f"data.train_num_samples), lower data.num_workers, or write smaller shards")
    sizes = shard_sizes(urls)
    if sizes is None:
        raise ValueError("exact epochs need the samples per shard: add a sizes.json beside the "
                         "shards (tools/make_shards.py writes one) or set data.resampled=true")
    groups = balance_shards(urls, sizes, slots)
    size_of = dict(zip(urls, sizes))
    largest = max(sum(size_of[u] for u in g) for g in groups)
    return StreamSpec(groups=tuple(map(tuple, groups)),
                      num_batches=max(1, math.ceil(largest / batch_size)), **common)


class _Health:
    """Counts and reports bad input inside one worker."""

    def __init__(self, max_bad_fraction: float) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = self.pending = self.raw = 0
        self.muted = False  # while skipping already-served samples after a resume
        self.errors: list[str] = []

    def sample_failed(self, sample: dict, reason: str) -> None:
        self.seen += 1
        self.bad += 1
        self.pending += 1
        self._report(f"skipped sample {sample.get('__key__')!r} in {sample.get('__url__')}: {reason}")
        if self.seen >= MIN_SEEN_FOR_FRACTION and self.bad > self.max_bad_fraction * self.seen:
            raise RuntimeError(
                f"{self.bad} of {self.seen} samples were bad, more than data.max_bad_fraction="
                f"{self.max_bad_fraction}; last problems: {self.errors[-3:]}")

    def tar_failed(self, url: str, exn: Exception) -> bool:
        """webdataset handler: count and warn, then continue with the next member or shard."""
        if not self.muted:
            self.pending += 1
            detail = exn.args[0] if exn.args else type(exn).__name__
            self._report(f"skipped unreadable data in shard {url}: {type(exn).__name__}: {detail}")
        return True

    def _report(self, line: str) -> None:
        self.errors = self.errors[-9:] + [line]
        log.warning(line)

    def take_pending(self) -> int:
        pending, self.pending = self.pending, 0
        return pending


def _read(urls: Iterator[str], health: _Health, give_up_after: Optional[int]) -> Iterator[dict]:
    """Raw samples of each shard in turn; unreadable shards or members are skipped and counted."""
    empty_in_row = 0
    for url in urls:
        got = 0
        for sample in wds.tarfile_samples([{"url": url}], handler=functools.partial(health.tar_failed, url)):
            got += 1
            health.raw += 1
            yield sample
        empty_in_row = 0 if got else empty_in_row + 1
        if give_up_after and empty_in_row >= give_up_after:
            raise RuntimeError(f"{empty_in_row} shard draws in a row gave no sample; last problems: "
                               f"{health.errors[-3:]}")


def _shuffled(samples: Iterator[dict], bufsize: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir shuffle of raw samples, as webdataset's ``shuffle`` but fully flushed at the end."""
    if bufsize <= 1:
        yield from samples
        return
    buffer: list[dict] = []
    for sample in samples:
        if len(buffer) < bufsize:
            buffer.append(sample)
            continue
        k = rng.randrange(len(buffer))
        yield buffer[k]
        buffer[k] = sample
    rng.shuffle(buffer)
    yield from buffer


def _resampled_urls(sources: Sequence[Source], rng: random.Random) -> Iterator[str]:
    weights = [s.weight for s in sources]
    while True:
        source = rng.choices(sources, weights=weights)[0] if len(sources) > 1 else sources[0]
        yield rng.choice(source.urls)


def raw_stream(spec: StreamSpec, epoch: int, worker: int, health: _Health) -> Iterator[dict]:
    """The shuffled raw samples of one worker in one epoch (deterministic)."""
    # Seeded from (seed, epoch, rank, worker); str seeds hash with SHA-512, stable across runs.
    rng = random.Random(f"{spec.seed}/{epoch}/{spec.rank}/{worker}")
    bufsize = spec.shuffle_buffer if spec.train else 0
    if spec.resampled:
        yield from _shuffled(_read(_resampled_urls(spec.sources, rng), health, MAX_EMPTY_DRAWS), bufsize, rng)
        return
    slot = spec.rank * spec.workers + worker
    group = list(spec.groups[slot]) if slot < len(spec.groups) else []
    while group:  # passes; a training worker tops up its last batches from the next pass
        if spec.train:
            rng.shuffle(group)
        before = health.raw
        # Flushed per pass, so each pass serves all of its samples before the next begins.
        yield from _shuffled(_read(iter(group), health, None), bufsize, rng)
        if health.raw == before:
            raise RuntimeError(f"no sample could be read from shards {group[:5]}"
                               f"{' ...' if len(group) > 5 else ''}; problems: {health.errors[-3:]}")
        if not spec.train:
            return


def collate(samples: list[dict], worker: int, raw: int, skipped: int, decoder: SampleDecoder) -> dict[str, torch.Tensor]:
    """Stack samples with the decoder's :meth:`~SampleDecoder.collate` and attach the stream metadata."""
    batch = decoder.collate(samples)
    # Plain ints, not tensors: each tensor in a batch crosses from the worker through its own
    # shared-memory segment, set up and mapped again for every batch.
    batch.update(__worker__=worker, __raw__=raw, __skipped__=skipped)
    return batch


def worker_batches(
    spec: StreamSpec, decoder: SampleDecoder, epoch: int, worker: int, done: int = 0, skip: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of one worker in one epoch.

    Args:
        spec: the stream spec.
        decoder: raw sample -> model inputs.
        epoch: epoch number (seeds).
        worker: worker index within the rank.
        done: batches this worker already served this epoch (resume).
        skip: raw samples this worker already consumed this epoch (resume; skipped undecoded).

    Returns:
        An iterator over at most ``spec.num_batches - done`` batches.
    """
    health = _Health(spec.max_bad_fraction)
    health.muted = skip > 0
    limit = None if spec.num_batches is None else spec.num_batches - done
    if limit is not None and limit <= 0:
        return
    batch: list[dict] = []
    position = 0
    for position, sample in enumerate(raw_stream(spec, epoch, worker, health), start=1):
        if position <= skip:
            continue
        health.muted = False
        try:
            batch.append(decoder(sample))
            health.seen += 1
        except BadSample as exn:
            health.sample_failed(sample, str(exn))
        if len(batch) == spec.batch_size:
            yield collate(batch, worker, position, health.take_pending(), decoder)
            batch = []
            if limit is not None:
                limit -= 1
                if limit == 0:
                    return
    if batch and not spec.train:
        yield collate(batch, worker, position, health.take_pending(), decoder)


class ShardStream(IterableDataset):
    """The per-rank dataset the loader iterates; each worker runs :func:`worker_batches`.

    Args:
        spec: from :func:`plan_stream`.
        decoder: raw sample -> model inputs.
    """

    def __init__(self, spec: StreamSpec, decoder: SampleDecoder) -> None:
        self.spec, self.decoder = spec, decoder
        self.epoch, self.rotation = 0, 0
        self.resume: dict[int, tuple[int, int]] = {}

    def set_position(self, epoch: int, rotation: int = 0, resume: Optional[dict] = None) -> None:
        """Set before workers start: epoch, and for a resume the first worker and what each served.

        Args:
            epoch: the epoch about to be read.
            rotation: the worker whose batch comes next; the loader's round-robin starts at its
                worker 0, so worker ``p`` plays worker ``(p + rotation) % workers``.
            resume: worker -> (batches served, raw samples consumed) this epoch.
        """
        self.epoch, self.rotation, self.resume = epoch, rotation, dict(resume or {})

    def __len__(self) -> int:
        if self.spec.num_batches is None:
            raise TypeError("a validation stream has no length")
        return self.spec.num_batches * self.spec.workers

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        physical, count = (info.id, info.num_workers) if info is not None else (0, 1)
        if count != self.spec.workers:
            raise RuntimeError(f"stream planned for {self.spec.workers} workers runs in {count}")
        worker = (physical + self.rotation) % count
        done, skip = self.resume.get(worker, (0, 0))
        return worker_batches(self.spec, self.decoder, self.epoch, worker, done, skip)
