"""Labelled evaluation sets: unreadable samples counted, one canonical order, limits the same on any ranks."""

from __future__ import annotations

import pytest
import torch
from shard_helpers import sample_members, write_dataset, write_tar

from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform

TRANSFORM = eval_transform(8)


def _read(folder, rank=0, world=1, limit=None, batch_size=3):
    batches = list(labeled_loader(str(folder), TRANSFORM, batch_size, rank=rank, world_size=world, limit=limit))
    labels = [int(x) for b in batches for x in b["label"]]
    index = [int(x) for b in batches for x in b["index"]]
    return labels, index, sum(b["skipped"] for b in batches), batches


def test_unreadable_samples_are_skipped_and_counted(tmp_path):
    write_dataset(tmp_path, [4])
    bad = sample_members(4)
    bad[0] = (bad[0][0], b"not an image")  # a corrupt JPEG
    no_label = [m for m in sample_members(5) if not m[0].endswith(".cls")]
    write_tar(tmp_path / "00001.tar", bad + no_label + sample_members(6))
    labels, _, skipped, batches = _read(tmp_path)
    assert labels == [0, 1, 2, 3, 6] and skipped == 2
    assert all(b["image"].shape[0] == len(b["label"]) for b in batches)


def test_a_rank_left_with_only_bad_samples_still_reports_them(tmp_path):
    write_tar(tmp_path / "00000.tar", [(n, b"junk" if n.endswith(".jpg") else d) for n, d in sample_members(0)])
    labels, _, skipped, batches = _read(tmp_path)
    assert labels == [] and skipped == 1 and batches[0]["image"].shape[0] == 0


@pytest.mark.parametrize("limit", [None, 7])
def test_ranks_read_disjoint_parts_that_restore_one_process_order(tmp_path, limit):
    write_dataset(tmp_path, [4, 3, 5])
    one_labels, one_index, _, _ = _read(tmp_path, limit=limit)
    parts = [_read(tmp_path, rank, 2, limit) for rank in range(2)]
    index = [i for p in parts for i in p[1]]
    labels = [x for p in parts for x in p[0]]
    assert sorted(index) == one_index and len(set(index)) == len(index)  # nothing twice, nothing lost
    assert [labels[i] for i in torch.tensor(index).argsort().tolist()] == one_labels
    assert one_labels == list(range(12 if limit is None else limit))  # limit: the set's first samples
