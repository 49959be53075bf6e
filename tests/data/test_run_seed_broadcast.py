"""The data stream's seed and skip count on a multi-rank run, in this process (the CLI runs of
``tests/data/test_run_seed.py`` check the seed end to end).

``run_seed`` is ``seed_everything``'s seed (Lightning's ``PL_GLOBAL_SEED``; 0 without one), rank
0's broadcast to every rank when there are several, read as it is with one process; and
``run_skipped`` gives rank 0 the run's saved total of skipped samples and every other rank 0.
"""

from __future__ import annotations

from types import SimpleNamespace

from mmssl.data.state import run_seed, run_skipped


class _Strategy:
    """Lightning's ``strategy.broadcast``, recorded: every rank gets rank 0's value (here 1234)."""

    def __init__(self) -> None:
        self.calls = []

    def broadcast(self, value, src=None):
        self.calls.append((value, src))
        return "1234"  # what rank 0 drew, as any picklable object comes back


def _trainer(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, strategy=_Strategy())


def test_the_seed_is_seed_everythings_and_0_without_one(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert run_seed() == 0 and run_seed(_trainer(1)) == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    assert run_seed() == 17
    one = _trainer(1)
    assert run_seed(one) == 17 and one.strategy.calls == []  # one process: nothing to broadcast


def test_several_ranks_take_rank_zeros_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    two = _trainer(2)
    seed = run_seed(two)
    assert seed == 1234 and type(seed) is int
    assert two.strategy.calls == [(17, 0)]


def test_rank_zero_carries_the_runs_skipped_total_and_the_others_start_from_zero():
    assert run_skipped({"skipped": 5}, rank=0) == 5
    assert run_skipped({"skipped": 5}, rank=1) == 0 and run_skipped({"skipped": 5}, rank=3) == 0
    assert run_skipped({}, rank=0) == 0
    assert type(run_skipped({"skipped": 5.0}, rank=0)) is int
