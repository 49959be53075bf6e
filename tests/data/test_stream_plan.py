"""Exact epochs at scale: plans without duplicates, shards re-dealt every epoch, every sample once."""

from __future__ import annotations

import random
from collections import Counter

from shard_helpers import count_tokenizer, write_dataset

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.pipeline import worker_batches
from mmssl.data.plan import Piece, Topology, describe, fresh_base, overlap, remaining, split_base


def test_imagenet_layout_on_640_slots_has_no_duplicates_and_equal_ranks():
    rng = random.Random(0)
    sizes = [rng.randint(900, 1100) for _ in range(1282)]
    topology = Topology(world=64, workers=10, batch=256, buffer=1000)
    plan = split_base(fresh_base(sizes, seed=0, epoch=0), topology)
    assert overlap(plan) == 0
    assert plan.left_out == sum(sizes) - 64 * plan.rank_batches * 256 and 0 <= plan.left_out < 64 * 256
    assert max(plan.worker_batches) - min(plan.worker_batches) <= 1
    per_slot = [sum(len(p) for p in slot) for slot in plan.slots]
    assert per_slot == [b * 256 for b in plan.worker_batches] * 64  # equal batches on every rank
    assert sum(per_slot) + plan.left_out == sum(sizes)


def test_a_laion_sized_layout_plans_without_overlap_and_leaves_out_less_than_a_global_batch():
    # How long it takes is a figure, not a test (a wall-clock bound fails on a loaded machine):
    # benchmarks/plan_speed.py prints it.
    sizes = [10000 - (i % 7) for i in range(41408)]
    plan = split_base(fresh_base(sizes, seed=0, epoch=0), Topology(world=128, workers=10, batch=256, buffer=1000))
    assert plan.left_out < 128 * 256 and overlap(plan) == 0


def test_describe_measures_mixing_between_epochs():
    summary = describe([100 + i % 5 for i in range(200)], Topology(world=4, workers=2, batch=16, buffer=10), epochs=3)
    assert summary.duplicates == (0, 0, 0) and summary.read + summary.left_out == summary.samples
    assert summary.rank_batches == summary.samples // 64 and summary.worker_batches[1] - summary.worker_batches[0] <= 1
    assert len(summary.slot_changed) == 2 and min(summary.slot_changed) > 0.8  # shards re-dealt every epoch


def test_overlap_counts_samples_read_twice():
    sizes = [10, 10]
    plan = split_base([Piece(0, 0, 10), Piece(1, 0, 10)], Topology(2, 1, 5, 1))
    assert overlap(plan) == 0
    doubled = plan.__class__(plan.slots + ((Piece(0, 8, 10), Piece(1, 0, 0, (3, 9))),), plan.worker_batches,
                             sum(sizes), 0)
    assert overlap(doubled) == 4


def test_remaining_matches_a_replayed_shuffle_buffer():
    pieces = [Piece(0, 3, 20), Piece(5, 0, 1, ()), Piece(2, 0, 9, (1, 4, 8)), Piece(7, 0, 30)]
    ids = [i for p in pieces for i in p.ids()]
    from mmssl.data.plan import ReservoirDraws

    for buffer in (1, 4, 16, 100):
        emitted = list(ReservoirDraws("s", buffer).shuffle(iter(ids)))
        assert sorted(emitted) == sorted(ids)
        for raw in (0, 1, 7, len(ids) - buffer, len(ids) - 2, len(ids)):
            if raw < 0:
                continue
            left = [i for p in remaining(pieces, raw, buffer, "s") for i in p.ids()]
            assert sorted(left) == sorted(set(ids) - set(emitted[:raw])), (buffer, raw)


def _module(data, **kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=2, num_workers=2, image_size=8, shuffle_buffer=4, tokenizer=count_tokenizer)
    return ImageTextDataModule(train_data=data, **{**defaults, **kwargs})


def test_every_sample_once_per_epoch_and_shards_change_slot(tmp_path):
    every = write_dataset(tmp_path, [5, 7, 3, 6, 4, 5, 6, 5])  # 41 samples: one left out per epoch
    module = _module(str(tmp_path))
    specs = [module.build_stream(str(tmp_path), True, rank, 2).spec for rank in range(2)]
    decoder = module.build_stream(str(tmp_path), True).decoder
    readers = []
    for epoch in range(3):
        labels, batches = [], Counter()
        for spec in specs:
            for worker in range(2):
                out = list(worker_batches(spec, decoder, epoch, worker))
                batches[spec.rank] += len(out)
                labels += [int(x) for b in out for x in b["label"]]
        plan = specs[0].plan(epoch)
        assert batches[0] == batches[1] == plan.rank_batches == 10
        assert len(labels) == len(set(labels)) == len(every) - plan.left_out == 40  # each once
        readers.append({p.shard: slot for slot, pieces in enumerate(plan.slots) for p in pieces})
    for before, after in zip(readers, readers[1:]):
        assert sum(before[s] != after.get(s) for s in before) >= len(before) // 2


def test_a_range_inside_a_local_shard_is_entered_by_seeking_to_the_same_samples(tmp_path):
    import io
    import tarfile

    from mmssl.data.reading import Health, _sample_start, _shard_samples, _tar

    members = [("__meta__", b"x"), ("dir/", None)]
    members += [(f"{'long_' * 30 if i == 4 else ''}s{i:03d}.{ext}", f"{i}{ext}".encode()) for i in range(8)
                for ext in ("jpg", "txt")]
    for fmt, name in (
        (tarfile.GNU_FORMAT, "gnu.tar"),
        (tarfile.PAX_FORMAT, "pax.tar"),
        (tarfile.USTAR_FORMAT, "ustar.tar"),
    ):
        path = tmp_path / name
        with tarfile.open(path, "w", format=fmt) as tar:
            for member, data in members:
                if fmt == tarfile.USTAR_FORMAT and len(member) > 100:
                    member = member[-20:]
                info = tarfile.TarInfo(member)
                if data is None:
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                else:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        every = list(enumerate(_tar(str(path), Health(1.0))))
        assert len(every) == 8
        for first in (1, 4, 7):
            assert _sample_start(str(path), first)[0] > 0  # entered by seeking, not read from the start
            got = list(_shard_samples(str(path), first, Health(1.0)))
            assert [(o, s["__key__"], s["jpg"]) for o, s in got] == [
                (o, s["__key__"], s["jpg"]) for o, s in every[first:]
            ]
        # A pipe: URL cannot seek: read from the start, the same samples come out.
        piped = list(_shard_samples(f"pipe:cat {path}", 5, Health(1.0)))
        assert [o for o, _ in piped] == [5, 6, 7]


def test_setup_reports_the_epoch_plan(tmp_path, caplog):
    import logging

    import pytest

    write_dataset(tmp_path, [5, 7, 3, 6, 4, 5, 6, 5])
    module = _module(str(tmp_path), train_num_samples=1000)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="train_num_samples=1000 applies to resampled"):
        module.setup("fit")
    assert any("1 ranks x 2 workers x batch 2: 41 samples, 40 read per epoch in 20 batches per rank, 1 left out, "
               "0 duplicates" in r.getMessage() for r in caplog.records)
