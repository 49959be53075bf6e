"""The epoch plan of exact-epoch training: which samples each (rank, worker) slot reads, with no I/O.

A sample is named by its shard and its offset in that shard (``sizes.json`` gives the sizes). An
epoch starts from a **base**, an ordered list of :class:`Piece` s:

- a fresh epoch's base is every shard, permuted by an RNG drawn from (seed, epoch), so each epoch
  deals shards to slots differently (open_clip re-deals shards every epoch too);
- an epoch resumed on another topology continues from what the checkpoint had not consumed
  (:func:`remaining`), which is how the resume is elastic.

:func:`split_base` cuts the base into contiguous runs, one per slot (slot = ``rank * workers +
worker``), like ``DistributedSampler(drop_last=True)``: every rank gets ``floor(total / (world x
batch))`` batches, and the samples that cannot fill a global batch (fewer than ``world x batch``)
are left out of the epoch. A rank's batches are dealt to its workers as evenly as whole batches
allow, the extra ones to the lowest workers, so the DataLoader's round-robin over workers gives
batch ``j`` of a rank to worker ``j % workers`` (torch skips a worker once it is exhausted; with
the extras first, none is exhausted before the last round). Runs may start and end inside a shard.
Plans are O(shards + slots): no per-sample list of the whole set is ever built.

Each slot shuffles its raw samples in a reservoir (:class:`ReservoirDraws`, webdataset's
``shuffle`` fully flushed). Its output order is a function of its input order and its draws only,
so the samples a slot consumed after emitting ``r`` raw samples follow from a simulation on
positions (:func:`remaining`), without reading a byte.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

# The reservoir draws its slot choices in blocks: the stream and the simulation take the same blocks.
DRAW_BLOCK = 4096


@dataclass(slots=True)
class Piece:
    """Samples of one shard: offsets ``lo..hi-1``, or only ``offsets`` (sorted, inside ``lo..hi-1``).

    Treated as immutable (:meth:`cut` makes new pieces); not ``frozen`` because a frozen
    dataclass is built several times slower, and a LAION-sized plan builds ~40k of them.

    Attributes:
        shard: index of the shard in the stream's URL list.
        lo: first offset (inclusive).
        hi: last offset (exclusive).
        offsets: when not empty, the only offsets wanted (left in a shuffle buffer at a checkpoint).
    """

    shard: int
    lo: int
    hi: int
    offsets: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.offsets) if self.offsets else self.hi - self.lo

    def cut(self, k: int) -> tuple["Piece", "Piece"]:
        """The first ``k`` samples and the rest."""
        if self.offsets:
            head, tail = self.offsets[:k], self.offsets[k:]
            return (Piece(self.shard, head[0], head[-1] + 1, head) if head else Piece(self.shard, 0, 0),
                    Piece(self.shard, tail[0], tail[-1] + 1, tail) if tail else Piece(self.shard, 0, 0))
        return Piece(self.shard, self.lo, self.lo + k), Piece(self.shard, self.lo + k, self.hi)

    def ids(self) -> Iterator[tuple[int, int]]:
        """``(shard, offset)`` of each sample, in reading order."""
        return ((self.shard, o) for o in (self.offsets or range(self.lo, self.hi)))


@dataclass(frozen=True)
class Topology:
    """How an epoch is read: ranks, loader workers per rank, samples per batch, shuffle buffer."""

    world: int
    workers: int
    batch: int
    buffer: int

    @property
    def slots(self) -> int:
        return self.world * self.workers


@dataclass(frozen=True)
class EpochPlan:
    """One epoch split over the slots of a topology.

    Attributes:
        slots: the pieces of each slot, in reading order (slot = ``rank * workers + worker``).
        worker_batches: batches of each worker (the same on every rank).
        total: samples in the base.
        left_out: samples of the base that no slot reads (fewer than ``world x batch``).
    """

    slots: tuple[tuple[Piece, ...], ...]
    worker_batches: tuple[int, ...]
    total: int
    left_out: int

    @property
    def rank_batches(self) -> int:
        return sum(self.worker_batches)


def split_batches(batches: int, workers: int) -> list[int]:
    """``batches`` dealt to ``workers``: equal shares, the remainder one each to the lowest workers."""
    return [batches // workers + (w < batches % workers) for w in range(workers)]


def fresh_base(sizes: Sequence[int], seed: int, epoch: int) -> list[Piece]:
    """Every shard, in an order drawn from (seed, epoch) (str seeds hash with SHA-512: stable)."""
    order = list(range(len(sizes)))
    random.Random(f"{seed}/{epoch}/shards").shuffle(order)
    return [Piece(s, 0, sizes[s]) for s in order if sizes[s] > 0]


def split_base(base: Sequence[Piece], topology: Topology) -> EpochPlan:
    """Cut the base into one contiguous run per slot, equal batches per rank (see module doc).

    Args:
        base: the epoch's pieces, in order.
        topology: ranks, workers, batch size.

    Returns:
        The plan; its tail beyond ``world x rank_batches x batch`` samples is left out.
    """
    total = sum(len(p) for p in base)
    rank_batches = total // (topology.world * topology.batch)
    per_worker = split_batches(rank_batches, topology.workers)
    slots: list[tuple[Piece, ...]] = []
    pieces, i, rest = list(base), 0, None  # rest: the uncut remainder of pieces[i]
    for _ in range(topology.world):
        for batches in per_worker:
            want, run = batches * topology.batch, []
            while want:
                piece = rest if rest is not None else pieces[i]
                if len(piece) <= want:
                    run.append(piece)
                    want -= len(piece)
                    i, rest = i + 1, None
                else:
                    head, rest = piece.cut(want)
                    run.append(head)
                    want = 0
            slots.append(tuple(run))
    used = topology.world * rank_batches * topology.batch
    return EpochPlan(tuple(slots), tuple(per_worker), total, total - used)


def slot_seed(seed: int, epoch: int, generation: int, slot: int) -> str:
    """Seed of a slot's shuffle buffer; ``generation`` counts elastic resumes inside the epoch."""
    return f"{seed}/{epoch}/{generation}/{slot}"


class ReservoirDraws:
    """The random choices of one slot's shuffle buffer (NumPy PCG64 seeded from a string).

    Slot choices are drawn in blocks of :data:`DRAW_BLOCK`, then one permutation flushes the buffer;
    the stream (:meth:`shuffle`) and the simulation (:func:`remaining`) draw identical blocks.
    """

    def __init__(self, seed: str, buffer: int) -> None:
        digest = hashlib.sha256(seed.encode()).digest()
        self.rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
        self.buffer = buffer

    def choices(self, steps: int) -> np.ndarray:
        """The first ``steps`` slot choices (draws whole blocks, as the stream does)."""
        blocks = [self.rng.integers(0, self.buffer, DRAW_BLOCK) for _ in range(-(-steps // DRAW_BLOCK))]
        return np.concatenate(blocks)[:steps] if blocks else np.zeros(0, dtype=np.int64)

    def shuffle(self, samples: Iterator) -> Iterator:
        """Reservoir shuffle (webdataset's ``shuffle``, flushed at the end) of any items."""
        if self.buffer <= 1:
            yield from samples
            return
        held: list = []
        block: list[int] = []
        for sample in samples:
            if len(held) < self.buffer:
                held.append(sample)
                continue
            if not block:
                block = self.rng.integers(0, self.buffer, DRAW_BLOCK).tolist()[::-1]
            k = block.pop()
            yield held[k]
            held[k] = sample
        for k in self.rng.permutation(len(held)).tolist():
            yield held[k]


def remaining(pieces: Sequence[Piece], raw: int, buffer: int, seed: str) -> list[Piece]:
    """What a slot has not consumed after emitting ``raw`` samples from its shuffle buffer.

    Simulates :meth:`ReservoirDraws.shuffle` on positions ``0..n-1`` of the slot's samples: after
    ``r`` emissions while streaming, positions ``0..buffer+r-1`` have entered the buffer; it holds
    ``buffer`` of them (each buffer place keeps the last position written to it), the unread tail
    ``buffer+r..n-1`` is a range. In the final flush, the permutation says which are still held.

    Args:
        pieces: the slot's pieces.
        raw: raw samples it emitted (consumed), bad ones included.
        buffer: its shuffle buffer size.
        seed: its :func:`slot_seed`.

    Returns:
        The unconsumed samples: one explicit piece per shard for the buffer's content (sorted by
        shard), then the unread tail's pieces in reading order.
    """
    n = sum(len(p) for p in pieces)
    if raw >= n:
        return []
    if raw <= 0:
        return [p for p in pieces if len(p)]
    if buffer <= 1:
        return _positions_to_pieces(pieces, np.zeros(0, dtype=np.int64), raw)
    draws = ReservoirDraws(seed, buffer)
    steps = max(0, n - buffer)  # emissions while streaming; the flush emits the rest
    held = _held_after(draws.choices(min(raw, steps)), min(buffer, n))
    if raw <= steps:
        return _positions_to_pieces(pieces, held, buffer + raw)
    order = draws.rng.permutation(len(held))
    return _positions_to_pieces(pieces, held[order[raw - steps:]], n)


def _held_after(choices: np.ndarray, buffer: int) -> np.ndarray:
    """Positions in a full buffer after its streaming steps: step ``i`` wrote position ``buffer + i``
    into place ``choices[i]``; each place keeps the last position written, else its first."""
    held = np.arange(buffer)
    last = np.full(buffer, -1)
    np.maximum.at(last, choices, np.arange(len(choices)))
    written = last >= 0
    held[written] = buffer + last[written]
    return held


def _positions_to_pieces(pieces: Sequence[Piece], held: np.ndarray, tail_from: int) -> list[Piece]:
    """Explicit pieces for ``held`` positions (grouped by shard), then pieces for ``tail_from..n-1``."""
    starts = np.cumsum([0] + [len(p) for p in pieces]).tolist()
    by_shard: dict[int, list[int]] = {}
    for pos in np.sort(held).tolist():
        i = bisect.bisect_right(starts, pos) - 1
        piece, k = pieces[i], pos - starts[i]
        by_shard.setdefault(piece.shard, []).append(piece.offsets[k] if piece.offsets else piece.lo + k)
    out = [Piece(s, min(o), max(o) + 1, tuple(sorted(o))) for s, o in sorted(by_shard.items())]
    i = bisect.bisect_right(starts, tail_from) - 1
    if i < len(pieces):
        out.append(pieces[i].cut(tail_from - starts[i])[1])
        out += pieces[i + 1:]
    return [p for p in out if len(p)]


@dataclass(frozen=True)
class Generation:
    """A checkpointed part of an epoch read on one topology, as recorded in the data state.

    Attributes:
        topology: how it was read.
        raw: per rank, per worker: raw samples consumed.
    """

    topology: Topology
    raw: tuple[tuple[int, ...], ...]


def epoch_base(sizes: Sequence[int], seed: int, epoch: int, history: Sequence[Generation] = ()) -> list[Piece]:
    """The base of ``epoch`` after the elastic resumes in ``history`` (oldest first).

    Args:
        sizes: samples per shard.
        seed: data seed.
        epoch: epoch number.
        history: the topologies this epoch was read on before, with what each slot consumed.

    Returns:
        The pieces still to read this epoch: the old slots' buffers and tails, old slot order.
    """
    base = fresh_base(sizes, seed, epoch)
    for generation, past in enumerate(history):
        plan = split_base(base, past.topology)
        workers = past.topology.workers
        base = []
        for slot, slot_pieces in enumerate(plan.slots):
            raw = past.raw[slot // workers][slot % workers]
            base += remaining(slot_pieces, raw, past.topology.buffer, slot_seed(seed, epoch, generation, slot))
    return base


def overlap(plan: EpochPlan) -> int:
    """Samples that two slots of ``plan`` would both read (0 for every plan this module makes).

    Explicit pieces are counted by offset, ranges by interval sweep per shard.
    """
    ranges: dict[int, list[tuple[int, int]]] = {}
    explicit: dict[int, list[int]] = {}
    for slot in plan.slots:
        for piece in slot:
            if piece.offsets:
                explicit.setdefault(piece.shard, []).extend(piece.offsets)
            elif len(piece):
                ranges.setdefault(piece.shard, []).append((piece.lo, piece.hi))
    twice = 0
    for shard, spans in ranges.items():
        spans.sort()
        end = -1
        for lo, hi in spans:
            twice += max(0, min(end, hi) - lo)
            end = max(end, hi)
        offs = explicit.pop(shard, [])
        twice += sum(1 for o in offs if any(lo <= o < hi for lo, hi in spans))
        twice += len(offs) - len(set(offs))
    twice += sum(len(o) - len(set(o)) for o in explicit.values())
    return twice


@dataclass(frozen=True)
class PlanSummary:
    """What :func:`describe` reports about the fresh plans of some epochs.

    Attributes:
        shards: shards in the data set.
        samples: samples in the data set.
        rank_batches: batches per rank per epoch.
        worker_batches: fewest and most batches of one worker.
        read: samples read per epoch (``world x rank_batches x batch``).
        left_out: samples per epoch no slot reads (which ones changes every epoch).
        duplicates: per epoch, samples two slots would both read (checked on the plan).
        skipped_reads: per epoch, samples read from a tar but not decoded because a slot's range
            starts inside a shard.
        slot_changed: per pair of consecutive epochs, fraction of shards read by other slots.
        rank_changed: per pair of consecutive epochs, fraction of shards read by other ranks.
        seconds: time to plan one epoch (mean).
    """

    shards: int
    samples: int
    rank_batches: int
    worker_batches: tuple[int, int]
    read: int
    left_out: int
    duplicates: tuple[int, ...]
    skipped_reads: tuple[int, ...]
    slot_changed: tuple[float, ...]
    rank_changed: tuple[float, ...]
    seconds: float


def describe(sizes: Sequence[int], topology: Topology, seed: int = 0, epochs: int = 2) -> PlanSummary:
    """Plan ``epochs`` fresh epochs of a data set (no I/O) and measure them.

    Args:
        sizes: samples per shard.
        topology: ranks, workers, batch.
        seed: data seed.
        epochs: epochs to plan (mixing is measured between consecutive ones).

    Returns:
        The summary.
    """
    import time

    plans, seconds = [], 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        plans.append(split_base(fresh_base(sizes, seed, epoch), topology))
        seconds += time.perf_counter() - start
    readers = [_readers(plan) for plan in plans]
    slot_changed, rank_changed = [], []
    for before, after in zip(readers, readers[1:]):
        shards = set(before) | set(after)
        slot_changed.append(sum(before.get(s) != after.get(s) for s in shards) / max(1, len(shards)))
        ranks = [({x // topology.workers for x in before.get(s, ())}, {x // topology.workers for x in after.get(s, ())})
                 for s in shards]
        rank_changed.append(sum(a != b for a, b in ranks) / max(1, len(shards)))
    first = plans[0]
    return PlanSummary(
        shards=len(sizes), samples=sum(sizes), rank_batches=first.rank_batches,
        worker_batches=(min(first.worker_batches), max(first.worker_batches)),
        read=first.total - first.left_out, left_out=first.left_out,
        duplicates=tuple(overlap(p) for p in plans),
        skipped_reads=tuple(sum(p.lo for slot in plan.slots for p in slot if not p.offsets) for plan in plans),
        slot_changed=tuple(slot_changed), rank_changed=tuple(rank_changed), seconds=seconds / epochs)


def _readers(plan: EpochPlan) -> dict[int, frozenset[int]]:
    """Shard -> the slots that read some of it."""
    out: dict[int, set[int]] = {}
    for slot, pieces in enumerate(plan.slots):
        for piece in pieces:
            out.setdefault(piece.shard, set()).add(slot)
    return {s: frozenset(v) for s, v in out.items()}
