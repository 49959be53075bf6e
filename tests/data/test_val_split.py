"""Validation shards are dealt over ranks first, so no rank is left without data when avoidable."""

from __future__ import annotations

from collections import Counter

import pytest

from mmssl.data.pipeline import plan_stream
from mmssl.data.sources import Source


def _shards_per_rank(num_shards: int, world: int, workers: int) -> list[int]:
    source = Source(tuple(f"s{i:05d}.tar" for i in range(num_shards)))
    groups = plan_stream([source], batch_size=4, rank=0, world_size=world, workers=workers, train=False).groups
    return [sum(len(groups[r * workers + w]) for w in range(workers)) for r in range(world)]


@pytest.mark.parametrize("num_shards, world, workers, expected", [
    (1, 2, 2, [1, 0]),            # the demo: one shard, two ranks (one rank must run empty)
    (3, 2, 2, [2, 1]),
    (16, 8, 8, [2] * 8),          # rank-major dealing gave [8, 8, 0, 0, 0, 0, 0, 0]
    (5, 8, 1, [1] * 5 + [0] * 3),  # more ranks than shards
])
def test_validation_shards_are_round_robin_over_ranks(num_shards, world, workers, expected):
    assert _shards_per_rank(num_shards, world, workers) == expected


def test_validation_split_reads_every_shard_once():
    source = Source(tuple(f"s{i:05d}.tar" for i in range(37)))
    groups = plan_stream([source], batch_size=4, world_size=4, workers=3, train=False).groups
    assert Counter(u for g in groups for u in g) == Counter(source.urls)


def test_fsdp_refuses_uneven_validation_at_start(tmp_path):
    """Under FSDP each forward is a collective: ranks must hold equal validation batch counts."""
    from shard_helpers import write_dataset

    from mmssl.data.datamodule import check_even_validation, validation_batches_per_rank

    write_dataset(tmp_path, [8, 8, 8])
    urls = [str(tmp_path / f"{i:05d}.tar") for i in range(3)]
    uneven = plan_stream([Source(tuple(urls))], batch_size=4, world_size=2, workers=1, train=False)
    assert validation_batches_per_rank(uneven) == [4, 2]
    with pytest.raises(ValueError, match=r"data.val_data='v': under FSDP .* ranks \[4, 2\]"):
        check_even_validation(uneven, "data.val_data='v'")
    even = plan_stream([Source(tuple(urls[:2]))], batch_size=4, world_size=2, workers=1, train=False)
    check_even_validation(even, "data.val_data='v'")  # [2, 2]: fine
