"""Resume on the same topology after bad samples made the ranks' raw-sample counts differ: each
rank must continue from its own count (the checkpoint holds every rank's), or it re-reads or skips
samples the uninterrupted run would have trained."""

from __future__ import annotations

import torch
from shard_helpers import write_shards_with_bad
from test_elastic_resume import _checkpoint, _labels, _module, _rank_batches

from mmssl.data.state import StreamPosition

SIZES = [9, 7, 8, 6, 10, 5, 7, 8, 4]  # good samples per shard (64)
BAD = {0: 4, 4: 3}  # shard -> broken JPEGs at its start, counted in sizes.json like any raw sample


def write_uneven(folder) -> None:
    write_shards_with_bad(folder, SIZES, BAD)


def test_each_rank_resumes_from_its_own_raw_count_after_uneven_bad_samples(tmp_path):
    write_uneven(tmp_path)
    data = str(tmp_path)
    module = _module(data, 2, max_bad_fraction=0.5)
    full = [_rank_batches(module, data, rank, 2) for rank in range(2)]
    state, _ = _checkpoint(module, data, world=2, k=4)
    raw = state["position"]["raw"]
    assert raw[0] != raw[1], raw  # the bad samples fell unevenly: the case under test
    skipped = [sum(int(b["__skipped__"]) for b in full[rank][:4]) for rank in range(2)]
    assert skipped[0] != skipped[1], skipped
    for rank in range(2):
        position = StreamPosition()
        position.load_state_dict(state["position"], module.build_stream(data, True, rank, 2).spec)
        tail = _rank_batches(module, data, rank, 2, position)
        assert [_labels([b]) for b in tail] == [_labels([b]) for b in full[rank][4:]], rank
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(tail, full[rank][4:]))
