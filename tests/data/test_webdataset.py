"""The shard stream: splitting, equal lengths, determinism, resume, mixing, reduced decode."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from PIL import Image
from shard_helpers import count_tokenizer, write_dataset

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.decode import open_image
from mmssl.data.pipeline import worker_batches


def _module(data, **kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=2, num_workers=2, image_size=8, shuffle_buffer=8, tokenizer=count_tokenizer)
    return ImageTextDataModule(train_data=data, **{**defaults, **kwargs})


def _labels(batches) -> list[int]:
    return [int(x) for b in batches for x in b["label"]]


def _rank_streams(module, data, world):
    """Per (rank, worker): the labels it yields in epoch 0, simulating ranks without processes."""
    out = {}
    for rank in range(world):
        stream = module.build_stream(data, True, rank, world)
        for worker in range(stream.spec.workers):
            out[rank, worker] = list(worker_batches(stream.spec, stream.decoder, 0, worker))
    return out


def test_exact_mode_splits_without_overlap_and_covers_everything(tmp_path):
    every = write_dataset(tmp_path, [7, 5, 4, 3, 3, 2])  # uneven shards, 24 samples
    module = _module(str(tmp_path))
    streams = _rank_streams(module, str(tmp_path), world=2)
    counts = {slot: len(batches) for slot, batches in streams.items()}
    assert len(set(counts.values())) == 1, counts  # every worker, so every rank: same batch count
    owners: dict[int, set] = {}
    for slot, batches in streams.items():
        assert all(b["image"].shape == (2, 3, 8, 8) for b in batches)  # full batches only
        for label in _labels(batches):
            owners.setdefault(label, set()).add(slot)
    assert sorted(owners) == every  # full coverage
    assert all(len(slots) == 1 for slots in owners.values())  # no sample read by two readers
    stream = module.build_stream(str(tmp_path), True, 0, 2)
    assert len(stream) == counts[0, 0] * 2  # the loader's length matches what is yielded


def test_fewer_shards_than_readers_are_split_inside_shards(tmp_path):
    every = write_dataset(tmp_path, [4, 4, 4])  # 3 shards, 2 ranks x 2 workers = 4 readers
    streams = _rank_streams(_module(str(tmp_path)), str(tmp_path), world=2)
    assert [len(streams[r, w]) for r in (0, 1) for w in (0, 1)] == [2, 1, 2, 1]  # 3 batches per rank
    labels = [x for batches in streams.values() for x in _labels(batches)]
    assert sorted(labels) == every  # 12 = 2 ranks x 3 batches x 2: all read, none twice


def test_an_epoch_smaller_than_one_global_batch_points_to_resampled(tmp_path):
    write_dataset(tmp_path, [2, 1])
    with pytest.raises(ValueError, match="cannot fill one global batch.*resampled=true"):
        _module(str(tmp_path)).build_stream(str(tmp_path), True, rank=0, world_size=2)


def test_resampled_mode_has_nominal_length_on_every_rank(tmp_path):
    write_dataset(tmp_path, [4, 4, 4])
    module = _module(str(tmp_path), resampled=True, train_num_samples=40)
    streams = _rank_streams(module, str(tmp_path), world=2)
    assert {len(b) for b in streams.values()} == {5}  # ceil(40 / (2 ranks x 2 workers x 2))


def test_same_config_gives_same_stream_and_epochs_differ(tmp_path):
    write_dataset(tmp_path, [6, 6, 6, 6])
    module = _module(str(tmp_path))
    stream = module.build_stream(str(tmp_path), True)

    def epoch(spec, number):
        return [_labels(worker_batches(spec, stream.decoder, number, w)) for w in range(2)]

    first, again = epoch(stream.spec, 0), epoch(module.build_stream(str(tmp_path), True).spec, 0)
    other_epoch = epoch(stream.spec, 1)
    assert first == again
    assert first != other_epoch and sorted(sum(first, [])) == sorted(sum(other_epoch, [])) == list(range(24))


def _through_module(module, loader, limit=None):
    out = []
    for batch in loader:
        out.append(_labels([module.on_before_batch_transfer(batch, 0)]))
        assert not any(k.startswith("__") for k in batch)  # metadata never reaches the model
        if limit is not None and len(out) == limit:
            break
    return out


def test_resume_mid_epoch_continues_with_the_remainder(tmp_path):
    write_dataset(tmp_path, [5, 4, 6, 3])
    full_module = _module(str(tmp_path))
    full = _through_module(full_module, full_module.train_dataloader())
    assert len(full) == len(full_module.train_dataloader())
    interrupted = _module(str(tmp_path))
    head = _through_module(interrupted, interrupted.train_dataloader(), limit=3)
    state = interrupted.state_dict()
    resumed = _module(str(tmp_path))
    resumed.load_state_dict(state)
    tail = _through_module(resumed, resumed.train_dataloader())
    assert head + tail == full
    # The epoch after the resumed one starts afresh (a reshuffled whole epoch), as in an uninterrupted run.
    loader = resumed.train_dataloader()
    _through_module(resumed, loader)
    next_epoch = _through_module(resumed, loader)
    assert len(next_epoch) == len(full) and next_epoch != full
    assert sorted(sum(next_epoch, [])) == sorted(sum(full, []))


def test_weighted_sources_are_mixed_by_weight(tmp_path):
    write_dataset(tmp_path / "a", [1] * 4, label=0)  # one-sample shards: 400 draws
    write_dataset(tmp_path / "b", [1] * 4, label=1)
    data = [{"data": str(tmp_path / "a"), "weight": 3.0}, {"data": str(tmp_path / "b"), "weight": 1.0}]
    module = _module(data, resampled=True, train_num_samples=400, num_workers=0, batch_size=8)
    stream = module.build_stream(data, True)
    labels = _labels(worker_batches(stream.spec, stream.decoder, 0, 0))
    assert len(labels) == 400
    assert 0.65 < Counter(labels)[0] / len(labels) < 0.85  # 3:1 -> 0.75


def test_weights_in_exact_mode_fail_clearly(tmp_path):
    write_dataset(tmp_path / "a", [2])
    with pytest.raises(ValueError, match="resampled=true"):
        _module(None).build_stream([{"data": str(tmp_path / "a"), "weight": 2}], True)


def test_sources_as_list_brace_and_double_colon(tmp_path):
    write_dataset(tmp_path, [2, 2, 2, 2])
    module = _module(None, num_workers=0)
    for spec in (f"{tmp_path}/{{00000..00003}}.tar", [f"{tmp_path}/00000.tar", f"{tmp_path}/{{00001..00003}}.tar"],
                 f"{tmp_path}/00000.tar::{tmp_path}/{{00001..00003}}.tar", f"pipe:cat {tmp_path}/{{00000..00003}}.tar"):
        stream = module.build_stream(spec, False)
        assert sorted(_labels(worker_batches(stream.spec, stream.decoder, 0, 0))) == list(range(8)), spec


def test_validation_stream_reads_each_sample_once_in_order(tmp_path):
    write_dataset(tmp_path, [3, 2])
    module = _module(None, num_workers=0, val_data=str(tmp_path))
    batches = list(module.val_dataloader())
    assert [b["image"].shape[0] for b in batches] == [2, 2, 1]
    assert _labels(batches) == [0, 1, 2, 3, 4]


def test_large_jpeg_decodes_at_reduced_size():
    buf = io.BytesIO()
    Image.new("RGB", (512, 384), (200, 10, 10)).save(buf, format="JPEG")
    image = open_image(buf.getvalue(), min_size=64)
    assert image.size == (128, 96)  # 1/4 scale: the largest reduction keeping both sides >= 64
    assert open_image(buf.getvalue()).size == (512, 384)


def test_training_batches_are_normalised_and_tokenised_once_per_batch(tmp_path):
    write_dataset(tmp_path / "d", [6])
    calls = []

    def tokenizer(texts):
        calls.append(len(texts))
        return count_tokenizer(texts)

    module = _module(str(tmp_path / "d"), num_workers=1, batch_size=6, image_mean=(0.5,) * 3, image_std=(0.25,) * 3,
                     tokenizer=tokenizer)
    stream = module.build_stream(module.train_data, True)
    batch = next(worker_batches(stream.spec, stream.decoder, 0, 0))
    assert calls == [6]  # one tokenizer call for the whole batch
    image = batch["image"]
    assert image.dtype == torch.float32 and image.shape == (6, 3, 8, 8)
    # (x / 255 - 0.5) / 0.25 lies in [-2, 2] and uses the whole range of these random pictures
    assert -2.0 - 1e-6 <= float(image.min()) < -1.0 and 1.0 < float(image.max()) <= 2.0 + 1e-6


def test_text_padding_is_trimmed_to_the_longest_caption_before_transfer(tmp_path):
    write_dataset(tmp_path / "d", [4])

    def padded(texts):  # caption i -> tokens [1, 2, ..., len] padded with 0 to 16
        out = torch.zeros(len(texts), 16, dtype=torch.long)
        for row, text in enumerate(texts):
            out[row, : len(text.split()[-1])] = 1 + torch.arange(len(text.split()[-1]))
        return out

    for trim, width in ((True, 5), (False, 16)):  # captions "caption 0".."caption 3": 1 digit...
        module = _module(str(tmp_path / "d"), num_workers=1, batch_size=4, tokenizer=padded, trim_text_padding=trim)
        stream = module.build_stream(module.train_data, True)
        batch = next(worker_batches(stream.spec, stream.decoder, 0, 0))
        batch["text"][0, 4] = 7  # one caption reaching position 5
        batch = module.on_before_batch_transfer(batch, 0)
        assert batch["text"].shape == (4, width)


def test_configs_naming_the_old_module_path_still_load(capsys):
    # Saved config.yaml files and user recipes name mmssl.data.webdataset.ImageTextDataModule.
    from mmssl.cli import cli_main
    from tests.conftest import REPO

    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--config", str(REPO / "configs/demo/mae.yaml"),
                  "--data.class_path=mmssl.data.webdataset.ImageTextDataModule", "--print_config"])
    assert done.value.code in (0, None)
    assert "ImageTextDataModule" in capsys.readouterr().out
