"""A stored-embeddings side file whose keys repeat, or whose rows do not match its keys, is a bad
shard (each sample named as a bad sample), never a silent pick of one row or an IndexError."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmssl.data.decode import BadSample
from mmssl.data.teacher_embeddings import FORMAT, MANIFEST, TeacherEmbeddings, side_file, write_side_file

URL = "/data/shards/00000.tar"


def _join(tmp_path, keys: list[str], rows: int) -> TeacherEmbeddings:
    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "embed_dim": 2, "logit_scale": 10.0}))
    image = np.arange(2 * rows, dtype=np.float32).reshape(rows, 2)
    write_side_file(side_file(str(tmp_path), URL), keys, image, image)
    return TeacherEmbeddings(str(tmp_path))


def test_a_key_given_twice_makes_the_side_file_a_bad_shard(tmp_path):
    join = _join(tmp_path, ["a", "b", "a"], 3)
    for key in ("a", "b"):
        with pytest.raises(BadSample, match=rf"{side_file(str(tmp_path), URL)} holds key 'a' twice \(rows 0 and 2\)"):
            join.lookup({"__url__": URL, "__key__": key})


def test_fewer_rows_than_keys_make_the_side_file_a_bad_shard(tmp_path):
    join = _join(tmp_path, ["a", "b", "c"], 2)
    with pytest.raises(BadSample, match=r"holds 3 keys but 2 image and 2 text rows"):
        join.lookup({"__url__": URL, "__key__": "c"})
