"""seed_per_rank: rank r of N > 1 continues from the run's seed + r; one process keeps its stream."""

from __future__ import annotations

import pytest
import torch

from mmssl.distributed import seed_per_rank


@pytest.fixture(autouse=True)
def _own_rng():
    with torch.random.fork_rng():  # the global stream is the other tests' as it was
        yield


def test_each_rank_of_several_gets_the_run_seed_plus_its_rank():
    for rank in (0, 1, 3):
        torch.manual_seed(100)
        seed_per_rank(rank, 4)
        assert torch.initial_seed() == 100 + rank


def test_one_process_keeps_its_stream_where_it_stands():
    torch.manual_seed(100)
    torch.rand(3)  # the stream has moved on since the seed
    expected = torch.rand(2, generator=torch.Generator().manual_seed(100).set_state(torch.get_rng_state()))
    seed_per_rank(0, 1)
    assert torch.equal(torch.rand(2), expected)
