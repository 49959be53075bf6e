"""What is read is checked against the metadata: shards that vanish or fail mid-run, a sizes.json
that lies or is malformed, and nonsense data-module values are bad data or errors, never silent."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
from shard_helpers import count_tokenizer, write_dataset

from mmssl.data.datamodule import ImageTextDataModule


def _module(data, **kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=2, num_workers=0, image_size=8, shuffle_buffer=1, tokenizer=count_tokenizer)
    return ImageTextDataModule(train_data=str(data), **{**defaults, **kwargs})


def _labels(module, loader) -> list[int]:
    """Labels of one epoch, each batch handed on as the trainer does (the position advances)."""
    return [int(x) for b in loader for x in module.on_before_batch_transfer(b, 0)["label"]]


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def _planned_urls(module, epoch: int = 0, slot: int = 0) -> list[str]:
    """Shard URLs of one slot's plan, in reading order."""
    spec = module.build_stream(module.train_data, True).spec
    return [spec.urls[p.shard] for p in spec.plan(epoch).slots[slot]]


def _vanish(path: str, how: str) -> None:
    if how == "unlink":
        import os

        os.unlink(path)
    else:  # replaced by garbage of the same size: readable bytes, no tar
        size = len(open(path, "rb").read())
        open(path, "wb").write(b"\x07garbage" * (size // 8))


@pytest.mark.parametrize("how", ["unlink", "garbage"])
def test_shards_vanishing_mid_epoch_are_bad_samples_and_stop_the_run(tmp_path, how, caplog):
    write_dataset(tmp_path, [8, 8, 8, 8])
    module = _module(tmp_path)
    loader = module.train_dataloader()
    order = _planned_urls(module)
    batches = iter(loader)
    next(batches)  # the run has started: the first shard is open
    for url in order[2:]:
        _vanish(url, how)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"), \
            pytest.raises(RuntimeError, match=r"16 of 32 samples were bad.*max_bad_fraction=0.1"):
        list(batches)
    text = _messages(caplog)
    for url in order[2:]:  # each named, with what went wrong and what it cost
        assert f"shard {url} gave 0 of the 8 samples" in text
        assert "counted as 8 bad samples" in text
    assert ("FileNotFoundError" if how == "unlink" else "ReadError") in text


def test_below_max_bad_fraction_the_epoch_says_it_repeats_samples(tmp_path, caplog):
    write_dataset(tmp_path, [8, 8, 8, 8])
    module = _module(tmp_path, max_bad_fraction=0.6)
    loader = module.train_dataloader()
    assert len(_labels(module, loader)) == 32  # epoch 0 whole
    for url in _planned_urls(module, 1)[1:3]:  # between epochs
        _vanish(url, "unlink")
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        labels = _labels(module, loader)
    counts = Counter(labels)
    assert len(labels) == 32 and len(counts) == 16 and module.position.skipped >= 16  # 16 read twice
    text = _messages(caplog)
    assert "16 of the 32 samples planned for this worker this epoch were bad or missing" in text
    assert "it repeats samples" in text


def test_a_sizes_json_that_says_too_many_stops_the_run_with_both_numbers(tmp_path, caplog):
    write_dataset(tmp_path, [16, 16])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 1000, "00001.tar": 16}))
    module = _module(tmp_path, batch_size=8)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"), pytest.raises(RuntimeError, match="max_bad_fraction"):
        _labels(module, module.train_dataloader())
    assert "00000.tar holds 16 samples, its sizes.json lists 1000" in _messages(caplog)


def test_a_sizes_json_that_says_too_few_warns_counts_and_reads_only_what_it_lists(tmp_path, caplog):
    write_dataset(tmp_path, [16, 16])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 8, "00001.tar": 16}))
    module = _module(tmp_path, max_bad_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        labels = _labels(module, module.train_dataloader())
    assert len(labels) == len(set(labels)) == 24  # what the plan lists, each once
    text = _messages(caplog)
    assert "00000.tar holds 16 samples, its sizes.json lists 8" in text and "8 not read" in text
    assert module.position.skipped == 8
    module = _module(tmp_path, max_bad_fraction=0.1)  # 8 of 32 is past it
    with pytest.raises(RuntimeError, match="max_bad_fraction=0.1"):
        _labels(module, module.train_dataloader())


@pytest.mark.parametrize("content, says", [
    ('{"00000.tar": -4}', r"non-negative integer.*'00000.tar': -4"),
    ("{not json", r"not valid JSON \(line 1"),
    ('{"00000.tar": "4"}', r"non-negative integer.*'00000.tar': '4'"),
    ('{"00000.tar": 100000000000000000000}', r"below 2\*\*63.*'00000.tar': 100000000000000000000"),  # #44 item 13
    ('{"00000.tar": 4.0}', r"'00000.tar': 4.0"),
    ('{"00000.tar": true}', r"'00000.tar': True"),
    ('[4]', "a mapping of shard file names"),
])
def test_a_malformed_sizes_json_is_refused_at_start_up_naming_the_file(tmp_path, content, says):
    write_dataset(tmp_path, [4])
    (tmp_path / "sizes.json").write_text(content)
    with pytest.raises(ValueError, match=f"{tmp_path / 'sizes.json'}.*{says}"):
        _module(tmp_path).setup("fit")


@pytest.mark.parametrize("key, value", [
    ("shuffle_buffer", 0), ("shuffle_buffer", -5), ("image_size", 0), ("crop_scale", (0.9, 0.2)),
    ("crop_scale", (0.0, 1.0)), ("eval_crop_pct", 0.0), ("eval_crop_pct", 1.5), ("train_num_samples", 0),
    ("image_mean", (0.5, 0.5)), ("image_std", (1.0, 0.0, 1.0)), ("batch_size", 0), ("num_workers", -1),
    ("max_bad_fraction", 1.5), ("image_key", ""),
])
def test_nonsense_data_module_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"data.init_args.{key} must be"):
        ImageTextDataModule(**{key: value})
