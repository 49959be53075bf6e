"""The training stream's checkpointed position, unit by unit: what it saves, what a load restores
on each rank, which epoch a resumed loader reads, and when it continues or starts afresh.

Planning needs only the shard sizes, so the specs here are built without files (as
:func:`~mmssl.data.pipeline.plan_stream` builds them from a ``sizes.json``)."""

from __future__ import annotations

import pytest

from mmssl.data import state
from mmssl.data.pipeline import EpochRun, ShardStream, StreamSpec, plan_stream
from mmssl.data.plan import Generation, Topology
from mmssl.data.state import EpochLoader, StreamPosition

SIZES = (9, 7, 8, 6, 10, 5, 7, 8, 4)  # 64 samples
TOPOLOGY = {"world": 2, "workers": 2, "batch": 3, "buffer": 5}


def _spec(rank: int = 0, world: int = 2, workers: int = 2, batch: int = 3, sizes=SIZES, **kwargs) -> StreamSpec:
    """An exact training stream of ``sizes`` (10 batches per rank on 2 ranks x batch 3)."""
    return plan_stream((), batch, rank, world, workers, sizes=sizes, shuffle_buffer=5, **kwargs)


def _resampled(rank: int = 0, samples: int = 60) -> StreamSpec:
    """A resampled stream of ``samples`` per epoch on 2 ranks x 2 workers x batch 3."""
    return plan_stream((), 3, rank, 2, 2, resampled=True, num_samples=samples, shuffle_buffer=5)


def _served(spec: StreamSpec, steps: list[tuple[int, int, int]], epoch: int = 0) -> StreamPosition:
    """A position that started ``epoch`` and served one batch per ``(worker, raw, skipped)``."""
    position = StreamPosition()
    position.start(epoch, spec)
    for worker, raw, skipped in steps:
        position.update(worker, raw, skipped)
    return position


def _loaded(state: dict, spec: StreamSpec) -> StreamPosition:
    position = StreamPosition()
    position.load_state_dict(state, spec)
    return position


STEPS = [(0, 4, 1), (1, 3, 0), (0, 7, 0)]  # 3 batches: worker 0 twice (7 raw), worker 1 once (3 raw)
SAVED = {"epoch": 0, "batches": [2, 1], "raw": [[7, 3], [6, 5]], "skipped": 1, "topology": TOPOLOGY,
         "offset": 0, "samples": 64, "history": []}  # rank 1 read more raw samples (bad ones) than rank 0


def test_a_position_saves_exactly_what_it_served():
    assert StreamPosition().state_dict() == {"epoch": -1, "batches": [], "raw": [[]], "skipped": 0, "topology": None,
                                             "offset": 0, "samples": None, "history": []}
    spec = _spec()
    position = _served(spec, [])
    assert position.state_dict() == {**SAVED, "batches": [0, 0], "raw": [[0, 0]], "skipped": 0}
    position = _served(spec, STEPS)
    assert position.state_dict() == {**SAVED, "raw": [[7, 3]]}  # this rank's raw counts alone by default
    assert position.state_dict([[7, 3], [6, 5]]) == SAVED
    assert _served(_resampled(), STEPS).state_dict()["samples"] is None  # no fixed data set in resampled mode


def test_a_fresh_epoch_runs_its_own_plan_from_the_start():
    spec = _spec()
    run = StreamPosition().start(1, spec)
    assert run == EpochRun(1, spec.plan(1)) and run.plan != spec.plan(0)
    assert StreamPosition().start(0, _resampled()) == EpochRun(0)


def test_each_rank_loads_its_own_counts_and_saves_them_back_unchanged():
    for rank in range(2):
        spec = _spec(rank)
        position = _loaded(SAVED, spec)
        assert (position.epoch, position.batches, position.raw) == (0, [2, 1], SAVED["raw"][rank])
        # ``skipped`` is the run's total over the ranks: rank 0 carries it, so the ranks' sum (what
        # data/skipped logs, and the next checkpoint holds) continues from it, counted once.
        assert (position.topology, position.skipped, position.samples) == (spec.topology, 1 - rank, 64)
        assert position.state_dict(SAVED["raw"], skipped=1) == SAVED  # a checkpoint right after the load
        # 3 batches went round-robin from worker 0: worker 1 serves next.
        assert position.start(0, spec) == EpochRun(0, spec.plan(0), 0, 0, 1, {0: (2, SAVED["raw"][rank][0]),
                                                                             1: (1, SAVED["raw"][rank][1])})


def test_a_resampled_stream_continues_on_its_own_topology():
    spec = _resampled(rank=1)
    assert spec.rank_batches == 10
    for steps, rotation in ((STEPS[:1], 1), (STEPS[:2], 0), (STEPS, 1)):
        served = _served(spec, steps)
        saved = served.state_dict([[9, 9], list(served.raw)])  # rank 0's counts, then this rank's
        position = _loaded(saved, spec)
        run = position.start(0, spec)
        resume = {0: (sum(1 for w, _, _ in steps if w == 0), saved["raw"][1][0]),
                  1: (sum(1 for w, _, _ in steps if w == 1), saved["raw"][1][1])}
        assert run == EpochRun(0, rotation=rotation, resume=resume), steps
        assert type(run.rotation) is int


def test_a_resume_from_the_last_batch_of_an_epoch_reads_the_next_one_afresh():
    # One batch per rank and epoch: 6 samples, 1 rank x 1 worker x batch 6.
    for spec in (_spec(world=1, workers=1, batch=6, sizes=(6,)), _resampled(samples=60)):
        steps = [(w % spec.workers, 6 * (w // spec.workers + 1), 0) for w in range(spec.rank_batches)]
        served = _served(spec, steps)
        position = _loaded(served.state_dict([list(served.raw)] * spec.world_size), spec)
        assert position.epoch_to_read(0, spec) == 1, spec
        run = position.start(0, spec)
        assert run.epoch == 1 and run.resume == {} and position.batches == [0] * spec.workers


def test_a_finished_epoch_started_again_without_a_resume_is_read_afresh():
    # A second fit on the same module after a whole epoch: the epoch the trainer names, from its start.
    for spec in (_spec(), _resampled()):
        steps = [(b % 2, 3 * (b // 2 + 1), 0) for b in range(spec.rank_batches)]
        position = _served(spec, steps)
        run = position.start(0, spec)
        assert run.epoch == 0 and run.resume == {} and position.batches == [0, 0], spec


def test_a_position_that_was_not_resumed_follows_the_trainers_epoch():
    spec = _spec()
    position = _served(spec, STEPS)  # 3 of epoch 0's 10 batches, then the trainer moves on
    assert position.epoch_to_read(1, spec) == 1
    assert position.start(1, spec) == EpochRun(1, spec.plan(1))
    position = _loaded(SAVED, spec)
    position.start(0, spec)  # the resumed epoch started: from now on the trainer decides
    assert not position.resumed and position.epoch_to_read(1, spec) == 1


def test_a_position_continues_only_on_the_topology_it_was_saved_on():
    position = _served(_spec(), STEPS)
    assert position.continues(0, _spec()) is not None
    for other in (_spec(batch=2), _spec(world=1), _spec(workers=3)):
        assert position.continues(0, other) is None, other.topology
    assert position.continues(1, _spec()) is None


def test_a_restarted_position_reads_the_trainers_epoch_from_its_beginning():
    old = {k: SAVED[k] for k in ("epoch", "batches", "raw", "skipped")}  # an older mmssl's: no topology
    one_rank = plan_stream((), 3, 0, 1, 2, resampled=True, num_samples=60, shuffle_buffer=5)
    for saved, spec in ((old, _spec()), ({**SAVED, "epoch": 2}, one_rank)):  # resampled, saved on 2 ranks
        with pytest.warns(UserWarning, match="restarts epoch"):
            position = _loaded(saved, spec)
        assert position.state_dict() == {**StreamPosition().state_dict(), "skipped": 1,
                                         "samples": saved.get("samples")}
        assert position.start(0, spec) == EpochRun(0, spec.plan(0) if spec.exact else None)


def test_an_elastic_load_records_the_old_generation_and_says_what_remains(monkeypatch):
    spec = _spec(world=1, batch=4)  # 1 rank x 2 workers x batch 4
    messages: list[str] = []
    monkeypatch.setattr(state, "rank_zero_info", messages.append)
    position = _loaded(SAVED, spec)
    history = [Generation(Topology(**TOPOLOGY), ((7, 3), (6, 5)))]
    assert position.history == history
    plan = spec.plan(0, history)
    assert (plan.total, plan.rank_batches, plan.left_out) == (39, 9, 3)
    assert messages == [
        "data: elastic resume of epoch 0 from 2 ranks x 2 workers x batch 3 to 1 x 2 x 4: 39 samples remain, "
        "9 batches per rank read 36 of them, 3 are left out; none consumed is read again"]
    saved = {**SAVED, "batches": [0, 0], "raw": [[0, 0]], "topology": {**TOPOLOGY, "world": 1, "batch": 4},
             "offset": 3, "history": [{"topology": TOPOLOGY, "raw": [[7, 3], [6, 5]]}]}
    assert position.state_dict() == saved
    # Saved before a batch of the new generation (no batch this generation, the old one's in history).
    assert _loaded(saved, spec).state_dict() == saved
    # The 3 batches of the old generation count towards the epoch; the new one starts at worker 0.
    assert position.start(0, spec) == EpochRun(0, plan, 1, 3, 0, {0: (0, 0), 1: (0, 0)})
    # Saved again after 2 batches of the new generation and resumed on its topology: it goes on.
    position.update(0, 5, 0)
    position.update(1, 4, 0)
    again = _loaded(position.state_dict(), spec)
    assert again.state_dict() == {**saved, "batches": [1, 1], "raw": [[5, 4]]}
    assert again.start(0, spec) == EpochRun(0, plan, 1, 3, 0, {0: (1, 5), 1: (1, 4)})
    # And resumed on a third topology: the 3 + 2 batches of the two earlier generations count.
    third = _spec(world=2, workers=1)
    twice = _loaded(position.state_dict(), third)
    assert twice.history == history + [Generation(Topology(1, 2, 4, 5), ((5, 4),))]
    assert twice.start(0, third) == EpochRun(0, third.plan(0, twice.history), 2, 5, 0, {0: (0, 0)})


def test_an_elastic_generation_resumed_at_its_end_reads_the_next_epoch():
    spec = _spec(world=1, batch=4)
    position = _loaded(SAVED, spec)
    plan = spec.plan(0, position.history)
    position.start(0, spec)
    for b in range(plan.rank_batches):  # the whole new generation: fewer batches than a fresh epoch's
        position.update(b % 2, 4 * (b // 2 + 1), 0)
    assert plan.rank_batches < spec.rank_batches
    resumed = _loaded(position.state_dict(), spec)
    assert resumed.epoch_to_read(0, spec) == 1
    assert resumed.start(0, spec) == EpochRun(1, spec.plan(1))


def test_a_position_plans_an_epoch_once_and_again_when_it_changes(monkeypatch):
    # An elastic plan simulates every old slot's shuffle buffer: seconds on a large data set.
    calls, plan = [], StreamSpec.plan
    monkeypatch.setattr(StreamSpec, "plan", lambda self, epoch, history=(): calls.append((epoch, len(history)))
                        or plan(self, epoch, history))
    spec = _spec(world=1)
    position = _loaded(SAVED, spec)
    for _ in range(2):
        position.epoch_to_read(0, spec)
        position.continues(0, spec)
    assert calls == [(0, 1)]
    position.load_state_dict({**SAVED, "epoch": 2}, spec)  # the same position, another checkpoint
    assert position.continues(2, spec).plan == plan(spec, 2, position.history) != plan(spec, 0, position.history)
    assert calls == [(0, 1), (2, 1)]


def test_a_loader_without_an_epoch_function_counts_its_epochs():
    spec = _spec(world=1, workers=1)
    stream = ShardStream(spec, None)
    loader = EpochLoader(stream, position=StreamPosition())
    for epoch in range(3):
        iter(loader)
        assert stream.run == EpochRun(epoch, spec.plan(epoch)) and loader.position.epoch == epoch


def test_a_loader_made_inside_an_epoch_continues_it():
    # A second fit on the same module after the first stopped mid-epoch (max_steps) makes a new loader.
    spec = _spec(world=1, workers=1)
    position = _served(spec, [(0, 3, 0), (0, 7, 0)])
    stream = ShardStream(spec, None)
    EpochLoader(stream, lambda: 0, position)
    assert stream.run == EpochRun(0, spec.plan(0), 0, 0, 0, {0: (2, 7)})


def test_an_elastic_load_on_as_many_ranks_but_another_topology_deals_the_rest_afresh():
    spec = _spec(workers=3)  # 2 ranks, as saved, but 3 workers each
    position = _loaded(SAVED, spec)
    assert position.history == [Generation(Topology(**TOPOLOGY), ((7, 3), (6, 5)))]
    assert position.start(0, spec) == EpochRun(0, spec.plan(0, position.history), 1, 3, 0,
                                               {0: (0, 0), 1: (0, 0), 2: (0, 0)})


def test_a_position_saved_without_the_later_keys_loads_with_their_defaults():
    # The keys an older mmssl did not write: skipped, raw, batches (at an epoch boundary), offset,
    # samples, history.
    spec = _spec()
    position = _loaded({"epoch": 3}, spec)
    assert position.state_dict() == {**StreamPosition().state_dict(), "epoch": 3}
    assert position.start(3, spec) == EpochRun(3, spec.plan(3))
    for rank in range(2):
        position = _loaded({k: v for k, v in SAVED.items() if k not in ("offset", "samples", "history")}, _spec(rank))
        assert (position.offset, position.samples, position.history) == (0, None, [])
        assert (
            position.raw == SAVED["raw"][rank] and position.start(0, _spec(rank)).resume[1][1] == SAVED["raw"][rank][1]
        )
    elastic = _loaded({k: v for k, v in SAVED.items() if k != "offset"}, _spec(world=1))
    assert elastic.offset == 3


@pytest.mark.parametrize("change, spec, message", [
    ({"raw": [[7, 3]]}, _spec(), "the data position does not record the topology it was saved on "
                                 "(a checkpoint of an older mmssl)"),  # one rank's raw counts of two
    ({"topology": None}, _spec(), "the data position does not record the topology it was saved on "
                                  "(a checkpoint of an older mmssl)"),
    ({"raw": None}, _spec(), "the data position does not record the topology it was saved on "
                             "(a checkpoint of an older mmssl)"),
    ({"samples": 60}, _spec(), "the data position was saved for 60 samples per epoch, the shards now hold 64"),
    ({}, plan_stream((), 3, 0, 1, 2, resampled=True, num_samples=60, shuffle_buffer=5),
     "resampled streams continue only on the topology they were saved on "
     "(Topology(world=2, workers=2, batch=3, buffer=5))"),
])
def test_a_position_that_cannot_continue_says_why_and_restarts_the_epoch(change, spec, message):
    state = {k: v for k, v in {**SAVED, **change}.items() if v is not None}
    with pytest.warns(UserWarning) as warned:
        position = _loaded(state, spec)
    assert [str(w.message) for w in warned] == [f"{message}: the data stream restarts epoch 0 from its beginning"]
    assert (position.epoch, position.batches, position.raw, position.topology) == (-1, [], [], None)
    assert position.start(0, spec).resume == {}
