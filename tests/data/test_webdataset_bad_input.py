"""Bad input is skipped with one warning naming shard and key, counted, and bounded."""

from __future__ import annotations

import logging

import pytest
import torch
from shard_helpers import count_tokenizer, image_bytes, sample_members, write_dataset, write_tar

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.pipeline import worker_batches


def _module(**kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=2, num_workers=0, image_size=8, shuffle_buffer=1, tokenizer=count_tokenizer)
    return ImageTextDataModule(**{**defaults, **kwargs})


def _bad_folder(tmp_path):
    jpg = image_bytes(1)
    write_tar(tmp_path / "00000.tar", [
        *sample_members(0),
        ("corrupt.jpg", b"not a jpeg at all"), ("corrupt.txt", b"a caption"),
        ("truncated.jpg", jpg[: len(jpg) // 2]), ("truncated.txt", b"a caption"),
        ("nocaption.jpg", jpg),
        ("empty.jpg", jpg), ("empty.txt", b"   "),
        ("latin1.jpg", jpg), ("latin1.txt", "caf\xe9".encode("latin-1")),
        ("noimage.txt", b"a caption"),
        *sample_members(1),
    ])
    good = b"".join(open(tmp_path / "00000.tar", "rb").read() for _ in range(1))
    (tmp_path / "00001.tar").write_bytes(good[: len(good) // 3])  # truncated tar
    (tmp_path / "00002.tar").write_bytes(b"\x00garbage" * 100)  # unreadable tar
    write_dataset(tmp_path / "more", [2])
    return [str(tmp_path / f"0000{i}.tar") for i in range(3)]


def test_every_kind_of_bad_input_is_skipped_counted_and_named(tmp_path, caplog):
    urls = _bad_folder(tmp_path)
    module = _module(val_data=urls)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        batches = list(module.val_dataloader())
        stripped = [module.on_before_batch_transfer(dict(b), 0) for b in batches]
    assert sum(b["image"].shape[0] for b in stripped) >= 2  # the good samples come through
    lines = [r.getMessage() for r in caplog.records]
    for key in ("corrupt", "truncated", "nocaption", "empty", "latin1", "noimage"):
        assert any(f"'{key}'" in line and "00000.tar" in line for line in lines), key
    assert any("00001.tar" in line for line in lines) and any("00002.tar" in line for line in lines)
    skipped = sum(int(b["__skipped__"]) for b in batches)
    assert skipped >= 6 + 2  # six bad samples, two bad shards
    # In training, the module accumulates the counts it logs as data/skipped.
    module = _module(train_data=urls, max_bad_fraction=1.0)
    for batch in module.train_dataloader():
        module.on_before_batch_transfer(batch, 0)
    assert module.position.skipped >= 8


def test_too_many_bad_samples_stop_with_the_fraction(tmp_path):
    members = []
    for i in range(70):
        members += [(f"b{i:03d}.jpg", b"broken"), (f"b{i:03d}.txt", b"x")]
    write_tar(tmp_path / "00000.tar", members + sample_members(0))
    module = _module(train_data=str(tmp_path), max_bad_fraction=0.1)
    with pytest.raises(RuntimeError, match="max_bad_fraction=0.1"):
        list(module.train_dataloader())


def test_no_readable_shard_fails_naming_the_shards(tmp_path):
    for i in range(2):
        (tmp_path / f"{i:05d}.tar").write_bytes(b"junk" * 50)
    (tmp_path / "sizes.json").write_text('{"00000.tar": 2, "00001.tar": 2}')  # claims samples it lacks
    module = _module(train_data=str(tmp_path))
    stream = module.build_stream(str(tmp_path), True)
    with pytest.raises(RuntimeError, match="no sample could be read from shards .*0000[01].tar"):
        list(worker_batches(stream.spec, stream.decoder, 0, 0))


def test_folder_without_shards_fails_clearly(tmp_path):
    module = _module(train_data=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no .tar shards in folder"):
        module.train_dataloader()


def test_missing_shards_are_named(tmp_path):
    write_dataset(tmp_path, [2])
    with pytest.raises(FileNotFoundError, match="00001.tar"):
        _module(train_data=f"{tmp_path}/{{00000..00001}}.tar").train_dataloader()


def test_a_sample_without_the_label_its_stream_has_is_skipped_not_the_label(tmp_path, caplog):
    unlabelled = [[m for m in sample_members(i) if not m[0].endswith(".cls")] for i in range(6)]
    # Shard 0: labelled, unlabelled, labelled. Shard 1: an unlabelled sample before the first label.
    write_tar(tmp_path / "00000.tar", sample_members(0) + unlabelled[1] + sample_members(2))
    write_tar(tmp_path / "00001.tar", unlabelled[3] + sample_members(4) + sample_members(5))
    for urls, labels in (([tmp_path / "00000.tar"], [[0, 2]]), ([tmp_path / "00001.tar"], [[4, 5]])):
        module = _module(val_data=[str(u) for u in urls])
        with caplog.at_level(logging.WARNING, logger="mmssl.data"):
            batches = list(module.val_dataloader())
        assert [b["label"].tolist() for b in batches] == labels  # the label stays; the sample without it goes...
        assert sum(int(b["__skipped__"]) for b in batches) == 1  # ...counted
    assert any("'s00001'" in r.getMessage() and "lacks ['label']" in r.getMessage() for r in caplog.records)
    assert any("'s00003'" in r.getMessage() and "lacks ['label']" in r.getMessage() for r in caplog.records)
    decoder = module._decoder(train=False)
    with pytest.raises(ValueError, match="mixes samples with keys"):
        decoder.collate([{"image": torch.zeros(3, 8, 8), "label": 1}, {"image": torch.zeros(3, 8, 8)}])
