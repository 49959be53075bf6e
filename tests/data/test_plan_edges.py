"""The stream plan's building blocks at their edges, each against a figure worked out another way.

``tests/data/test_stream_plan.py`` checks the plans at scale (no duplicates, equal ranks, every
sample once); here: the exact pieces a cut or a split makes, the summary ``tools/plan_stream.py``
prints (recomputed sample by sample), the overlap count's boundaries, and the pinned draws of a
slot's shuffle buffer (a checkpoint's stream position is only valid while they stay the same).
"""

from __future__ import annotations

import pytest

from mmssl.data.plan import (
    EpochPlan,
    Piece,
    ReservoirDraws,
    Topology,
    describe,
    epoch_base,
    fresh_base,
    overlap,
    remaining,
    split_base,
)


def test_a_cut_of_explicit_offsets_gives_tight_pieces_and_empty_ends():
    piece = Piece(3, 1, 8, (1, 4, 7))
    assert piece.cut(2) == (Piece(3, 1, 5, (1, 4)), Piece(3, 7, 8, (7,)))
    assert piece.cut(0) == (Piece(3, 0, 0), piece)
    assert piece.cut(3) == (piece, Piece(3, 0, 0))
    assert [len(p) for p in piece.cut(0) + piece.cut(3)] == [0, 3, 3, 0]
    assert Piece(2, 5, 9).cut(1) == (Piece(2, 5, 6), Piece(2, 6, 9))


def test_a_piece_that_fills_a_slot_exactly_is_not_cut():
    plan = split_base([Piece(0, 0, 4), Piece(1, 0, 4), Piece(2, 0, 3)], Topology(world=2, workers=1, batch=2, buffer=1))
    assert plan.slots == ((Piece(0, 0, 4),), (Piece(1, 0, 4),))  # no empty remainder handed on
    assert (plan.worker_batches, plan.total, plan.left_out) == ((2,), 11, 3)


def test_the_base_leaves_out_empty_shards_only_and_follows_the_seed():
    sizes = [3, 0, 1, 2, 1, 4, 2, 1]
    base = fresh_base(sizes, seed=7, epoch=1)
    assert sorted(p.shard for p in base) == [0, 2, 3, 4, 5, 6, 7]
    assert all((p.lo, p.hi) == (0, sizes[p.shard]) for p in base)
    assert epoch_base(sizes, 7, 1) == base  # no elastic history: the fresh base of that seed
    assert [p.shard for p in epoch_base(sizes, 8, 1)] != [p.shard for p in base]


def _oracle(sizes, topology, seed, epochs):
    """The summary's figures from the samples each slot reads (``Piece.ids``), not its pieces."""
    readers, skipped = [], []
    for epoch in range(epochs):
        plan = split_base(fresh_base(sizes, seed, epoch), topology)
        read: dict[int, set[int]] = {}
        starts = 0
        for slot, pieces in enumerate(plan.slots):
            previous = None
            for shard, offset in (i for p in pieces for i in p.ids()):
                read.setdefault(shard, set()).add(slot)
                if shard != previous:
                    starts += offset  # the samples before it in its tar are read and skipped
                previous = shard
        readers.append(read)
        skipped.append(starts)
    slot_changed, rank_changed = [], []
    for before, after in zip(readers, readers[1:]):
        shards = sorted(set(before) | set(after))
        slot_changed.append(sum(before.get(s) != after.get(s) for s in shards) / len(shards))
        rank = lambda r, s: {x // topology.workers for x in r.get(s, ())}  # noqa: E731
        rank_changed.append(sum(rank(before, s) != rank(after, s) for s in shards) / len(shards))
    return tuple(skipped), tuple(slot_changed), tuple(rank_changed), readers


def test_the_plan_summary_equals_a_count_over_the_samples(monkeypatch):
    sizes = [3, 5, 4, 0, 2, 6, 1, 1]  # an empty shard, one-sample shards, one sample left out per epoch
    topology = Topology(world=2, workers=2, batch=2, buffer=1)
    seen_read_once, seen_rank_kept = False, False
    for seed in range(6):
        summary = describe(sizes, topology, seed=seed, epochs=3)
        skipped, slot_changed, rank_changed, readers = _oracle(sizes, topology, seed, 3)
        assert (summary.shards, summary.samples, summary.rank_batches, summary.worker_batches) == (8, 22, 5, (2, 3))
        assert (summary.read, summary.left_out, summary.duplicates) == (20, 2, (0, 0, 0))
        assert summary.skipped_reads == skipped and summary.slot_changed == slot_changed, seed
        assert summary.rank_changed == rank_changed, seed
        seen_read_once |= any(set(a) != set(b) for a, b in zip(readers, readers[1:]))
        seen_rank_kept |= slot_changed != rank_changed
    # the cases that make the union of shards and the rank of a slot matter did occur
    assert seen_read_once and seen_rank_kept
    defaults = describe(sizes, topology)
    assert defaults.skipped_reads == describe(sizes, topology, seed=0, epochs=2).skipped_reads
    assert len(defaults.slot_changed) == 1 and defaults.skipped_reads == _oracle(sizes, topology, 0, 2)[0]
    one = describe(sizes, topology, epochs=1)  # tools/plan_stream.py --epochs 1: nothing to compare
    assert (one.rank_batches, one.slot_changed, one.rank_changed) == (5, (), ())
    # seconds: the mean time of one epoch's planning, on a clock that ticks 1 s then 3 s
    ticks = iter([10.0, 11.0, 20.0, 23.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks))
    assert describe(sizes, topology, epochs=2).seconds == 2.0


def test_overlap_counts_the_boundaries_of_a_range_and_repeated_offsets():
    def plan(*slots):
        return EpochPlan(tuple(slots), (1,) * len(slots), 0, 0)

    # shard 0 read as the range 0..3; explicit offsets 0 (its first: twice), 4 (just past it: once), 8
    assert overlap(plan((Piece(0, 0, 4),), (Piece(0, 0, 9, (0, 4, 8)),))) == 1
    assert overlap(plan((Piece(0, 0, 4),), (Piece(0, 8, 9, (8,)),), (Piece(0, 4, 9, (4, 8)),))) == 1
    # explicit pieces of a shard no range reads: each repeat once
    assert overlap(plan((Piece(2, 1, 3, (1, 2)),), (Piece(2, 1, 3, (1, 2)),), (Piece(2, 2, 3, (2,)),))) == 3
    assert overlap(plan((Piece(1, 0, 5),), (Piece(1, 5, 9),))) == 0  # adjacent ranges share nothing


def test_a_slots_shuffle_draws_are_pinned():
    # A checkpoint records how many samples each slot emitted; resuming replays these draws. If the
    # seed's hashing or the draw changes, checkpoints written before the change resume wrong.
    assert ReservoirDraws("0/0/0/0", 8).choices(6).tolist() == [0, 7, 6, 1, 2, 5]
    assert list(ReservoirDraws("s", 2).shuffle(iter(range(6)))) != list(range(6))  # buffer 2 shuffles
    assert list(ReservoirDraws("s", 1).shuffle(iter(range(6)))) == list(range(6))


def test_remaining_keeps_ranges_where_no_buffer_holds_samples():
    pieces = [Piece(0, 3, 9), Piece(2, 1, 9, (1, 4, 8)), Piece(7, 0, 0), Piece(7, 0, 5)]
    assert remaining(pieces, 0, 4, "t") == [pieces[0], pieces[1], pieces[3]]  # nothing emitted: as planned
    assert remaining(pieces, 2, 1, "t") == [Piece(0, 5, 9), pieces[1], pieces[3]]  # no shuffle: the rest in order
    assert remaining(pieces, 7, 1, "t") == [Piece(2, 4, 9, (4, 8)), pieces[3]]
    assert remaining(pieces, 14, 4, "t") == []


@pytest.mark.parametrize("buffer", [2, 3])
def test_remaining_after_a_small_buffer_is_what_the_stream_did_not_emit_in_tight_pieces(buffer):
    pieces = [Piece(0, 3, 9), Piece(2, 1, 9, (1, 4, 8)), Piece(7, 0, 5)]
    ids = [i for p in pieces for i in p.ids()]
    emitted = list(ReservoirDraws("t", buffer).shuffle(iter(ids)))
    for raw in range(len(ids) + 1):
        left = remaining(pieces, raw, buffer, "t")
        assert sorted(i for p in left for i in p.ids()) == sorted(set(ids) - set(emitted[:raw])), raw
        for p in left:
            if p.offsets:
                assert (p.lo, p.hi) == (min(p.offsets), max(p.offsets) + 1), p  # the reader stops at hi
