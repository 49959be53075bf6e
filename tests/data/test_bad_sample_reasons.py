"""Each reason a sample is bad, alone: one defect in one sample between two good ones, skipped and
counted exactly once, with its reason named; the good samples keep their labels."""

from __future__ import annotations

import logging

import pytest
from shard_helpers import count_tokenizer, image_bytes, sample_members, write_tar

from mmssl.data.datamodule import ImageTextDataModule

JPG = image_bytes(1)
# Every member of a good sample (image, caption, label) but one defect each.
DEFECTS = {
    "no image": ([("bad.txt", b"a caption"), ("bad.cls", b"1")], "no image (looked for"),
    "no caption": ([("bad.jpg", JPG), ("bad.cls", b"1")], "no caption 'txt'"),
    "caption not UTF-8": ([("bad.jpg", JPG), ("bad.txt", "caf\xe9".encode("latin-1")), ("bad.cls", b"1")],
                          "caption 'txt' is not UTF-8"),
    "empty caption": ([("bad.jpg", JPG), ("bad.txt", b" \n\t "), ("bad.cls", b"1")], "empty caption 'txt'"),
    "label not an integer": ([("bad.jpg", JPG), ("bad.txt", b"a caption"), ("bad.cls", b"one")],
                             "'cls' is not an integer"),
    "label not ASCII": ([("bad.jpg", JPG), ("bad.txt", b"a caption"), ("bad.cls", "\xb9".encode("latin-1"))],
                        "'cls' is not an integer"),
    "undecodable image": ([("bad.jpg", b"not a jpeg"), ("bad.txt", b"a caption"), ("bad.cls", b"1")],
                          "unreadable jpg"),
    "truncated image": ([("bad.jpg", JPG[: len(JPG) // 2]), ("bad.txt", b"a caption"), ("bad.cls", b"1")],
                        "unreadable jpg"),
    "missing label": ([("bad.jpg", JPG), ("bad.txt", b"a caption")], "lacks ['label']"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_one_defect_skips_one_sample_with_its_reason(tmp_path, caplog, defect):
    members, reason = DEFECTS[defect]
    write_tar(tmp_path / "00000.tar", sample_members(0) + members + sample_members(2))
    module = ImageTextDataModule(val_data=str(tmp_path / "00000.tar"), batch_size=2, num_workers=0, image_size=8,
                                 shuffle_buffer=1, tokenizer=count_tokenizer)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        batches = list(module.val_dataloader())
    assert [int(x) for b in batches for x in b["label"]] == [0, 2]  # the good ones, labels intact
    assert [b["text"].tolist() for b in batches] == [[[len("caption 0")], [len("caption 2")]]]
    assert sum(int(b["__skipped__"]) for b in batches) == 1
    skipped = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(skipped) == 1 and "'bad'" in skipped[0] and "00000.tar" in skipped[0], skipped
    assert reason in skipped[0], skipped[0]


def test_a_good_shard_skips_nothing(tmp_path, caplog):
    write_tar(tmp_path / "00000.tar", sample_members(0) + sample_members(1) + sample_members(2))
    module = ImageTextDataModule(val_data=str(tmp_path / "00000.tar"), batch_size=2, num_workers=0, image_size=8,
                                 shuffle_buffer=1, tokenizer=count_tokenizer)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        batches = list(module.val_dataloader())
    assert [int(x) for b in batches for x in b["label"]] == [0, 1, 2]
    assert sum(int(b["__skipped__"]) for b in batches) == 0 and not caplog.records
