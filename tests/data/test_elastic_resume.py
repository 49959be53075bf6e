"""Mid-epoch resume on the same topology (the exact next batches) and on another one (elastic)."""

from __future__ import annotations

import io
import logging

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image
from shard_helpers import count_tokenizer, write_dataset, write_tar

from mmssl.checkpoints import read_checkpoint
from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.pipeline import worker_batches
from mmssl.data.state import StreamPosition

SIZES = [9, 7, 8, 6, 10, 5, 7, 8, 4]  # 64 samples


def _module(data, workers: int, **kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=3, num_workers=workers, image_size=8, shuffle_buffer=5, tokenizer=count_tokenizer)
    return ImageTextDataModule(train_data=data, **{**defaults, **kwargs})


def _rank_batches(module, data, rank, world, position=None, epoch=0):
    """One rank's batches in loader order (torch's round-robin over workers), from ``position``."""
    stream = module.build_stream(data, True, rank, world)
    spec = stream.spec
    run = (position or StreamPosition()).start(epoch, spec)
    physical = []
    for p in range(spec.workers):
        worker = (p + run.rotation) % spec.workers
        done, skip = run.resume.get(worker, (0, 0))
        physical.append(list(worker_batches(spec, stream.decoder, epoch, worker, done, skip, run.plan, run.generation)))
    out = []
    while any(physical):  # the extra batches sit with the first workers, so none is exhausted early
        for batches in physical:
            if batches:
                out.append(batches.pop(0))
    assert len(out) == run.length(spec) - run.offset - sum(d for d, _ in run.resume.values())
    return out


def _labels(batches) -> list[int]:
    return [int(x) for b in batches for x in b["label"]]


def _checkpoint(module, data, world, k):
    """Run ``world`` simulated ranks for ``k`` batches each; the state they checkpoint, and what they consumed."""
    consumed, raw = [], []
    for rank in range(world):
        position = StreamPosition()
        spec = module.build_stream(data, True, rank, world).spec
        position.start(0, spec)
        for batch in _rank_batches(module, data, rank, world)[:k]:
            position.update(int(batch["__worker__"]), int(batch["__raw__"]), int(batch["__skipped__"]))
            consumed += _labels([batch])
        raw.append(list(position.raw))
    return {"position": position.state_dict(raw), "seed": module.seed}, consumed


def _resume(data, state, world, workers):
    module = _module(data, workers)
    labels, counts = [], []
    for rank in range(world):
        position = StreamPosition()
        spec = module.build_stream(data, True, rank, world).spec
        position.load_state_dict(state["position"], spec)
        batches = _rank_batches(module, data, rank, world, position)
        counts.append(len(batches))
        labels += _labels(batches)
    assert len(set(counts)) == 1  # equal batches on every rank: DDP cannot hang
    return labels, spec.plan(0, position.history)


@pytest.mark.parametrize("world, workers", [(1, 3), (4, 1)])
def test_elastic_resume_reads_the_rest_of_the_epoch_once(tmp_path, world, workers):
    every = write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    state, consumed = _checkpoint(_module(data, 2), data, world=2, k=3)
    first_plan = _module(data, 2).build_stream(data, True, 0, 2).spec.plan(0)
    rest, plan = _resume(data, state, world, workers)
    assert len(consumed) == 2 * 3 * 3 and not set(consumed) & set(rest)  # nothing consumed read again
    assert len(rest) == len(set(rest))  # nothing read twice
    assert plan.total == len(every) - first_plan.left_out - len(consumed)  # what remained, exactly
    assert len(rest) == plan.total - plan.left_out and plan.left_out < world * 3  # left out: reported, < a batch
    left_out = set(every) - set(consumed) - set(rest)
    assert len(left_out) == first_plan.left_out + plan.left_out


def test_elastic_resume_twice_in_one_epoch(tmp_path):
    every = write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    state, consumed = _checkpoint(_module(data, 2), data, world=2, k=2)
    first_plan = _module(data, 2).build_stream(data, True, 0, 2).spec.plan(0)
    # Resumed on 1 rank x 3 workers, which checkpoints after 2 of its batches; then on 2 x 1.
    module = _module(data, 3)
    position = StreamPosition()
    spec = module.build_stream(data, True, 0, 1).spec
    position.load_state_dict(state["position"], spec)
    middle_plan = spec.plan(0, position.history)
    for batch in _rank_batches(module, data, 0, 1, position)[:2]:
        position.update(int(batch["__worker__"]), int(batch["__raw__"]), 0)
        consumed += _labels([batch])
    second = {"position": position.state_dict(), "seed": module.seed}
    assert second["position"]["offset"] == 2 and len(second["position"]["history"]) == 1
    rest, plan = _resume(data, second, world=2, workers=1)
    assert len(consumed) == 2 * 2 * 3 + 2 * 3
    assert not set(consumed) & set(rest) and len(rest) == len(set(rest))
    left_out = set(every) - set(consumed) - set(rest)
    assert len(left_out) == first_plan.left_out + middle_plan.left_out + plan.left_out


def test_same_topology_resume_gives_the_exact_next_batches_on_every_rank(tmp_path):
    write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    module = _module(data, 2)
    full = [_rank_batches(module, data, rank, 2) for rank in range(2)]
    state, _ = _checkpoint(module, data, world=2, k=5)
    for rank in range(2):
        position = StreamPosition()
        position.load_state_dict(state["position"], module.build_stream(data, True, rank, 2).spec)
        tail = _rank_batches(module, data, rank, 2, position)
        assert [_labels([b]) for b in tail] == [_labels([b]) for b in full[rank][5:]]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(tail, full[rank][5:]))


def _noise_shards(folder, sizes):
    """Shards of random-noise PNGs (a crop of noise shows where it was taken), ``cls`` = index."""
    rng, index, sizes_json = np.random.default_rng(0), 0, {}
    folder.mkdir(parents=True, exist_ok=True)
    for s, count in enumerate(sizes):
        members = []
        for _ in range(count):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
            members += [(f"k{index:04d}.png", buf.getvalue()), (f"k{index:04d}.txt", b"noise"),
                        (f"k{index:04d}.cls", str(index).encode())]
            index += 1
        write_tar(folder / f"{s:05d}.tar", members)
        sizes_json[f"{s:05d}.tar"] = count
    (folder / "sizes.json").write_text(str(sizes_json).replace("'", '"'))


def test_a_sample_gets_the_same_crop_after_a_resume_on_any_topology(tmp_path):
    _noise_shards(tmp_path, [7, 6, 8, 5])
    data = str(tmp_path)
    crops = dict(crop_scale=(0.2, 1.0), hflip=True)
    module = _module(data, 2, **crops)
    images = {}
    for rank in range(2):
        for batch in _rank_batches(module, data, rank, 2):
            images.update(zip(_labels([batch]), batch["image"]))
    assert len({tuple(v.flatten()[:20].tolist()) for v in images.values()}) == len(images)
    state, _ = _checkpoint(module, data, world=2, k=2)
    for world, workers in ((2, 2), (1, 3)):
        resumed = _module(data, workers, **crops)
        for rank in range(world):
            position = StreamPosition()
            position.load_state_dict(state["position"], resumed.build_stream(data, True, rank, world).spec)
            for batch in _rank_batches(resumed, data, rank, world, position):
                for label, image in zip(_labels([batch]), batch["image"]):
                    assert torch.equal(image, images[label]), (world, workers, label)


def test_a_resumed_module_reports_and_finishes_the_epoch_through_its_loader(tmp_path, caplog):
    every = write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    state, consumed = _checkpoint(_module(data, 2), data, world=2, k=3)
    module = _module(data, 2)  # 1 rank x 2 workers, saved on 2 x 2
    module.load_state_dict(state)
    assert module.state_dict()["position"] == state["position"]  # kept until applied
    with caplog.at_level(logging.INFO):
        loader = module.train_dataloader()
    assert any("elastic resume of epoch 0 from 2 ranks x 2 workers" in r.getMessage() for r in caplog.records)
    rest = []
    for batch in loader:
        rest += _labels([module.on_before_batch_transfer(batch, 0)])
    assert len(loader) == 3 + len(rest) // 3  # the resumed epoch's own length, earlier batches included
    assert not set(rest) & set(consumed) and len(rest) == len(set(rest))
    assert len(set(every) - set(rest) - set(consumed)) < 2 * 3 + 3  # both plans left out less than a batch each
    saved = module.state_dict()["position"]
    assert saved["topology"] == {"world": 1, "workers": 2, "batch": 3, "buffer": 5} and saved["offset"] == 3


def test_a_resume_with_less_than_a_global_batch_left_ends_the_epoch(tmp_path):
    write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    state, _ = _checkpoint(_module(data, 2), data, world=2, k=10)  # the whole epoch: 60 read, 4 left out
    module = _module(data, 1)
    module.load_state_dict(state)
    loader = module.train_dataloader()
    assert len(loader) == 10 and list(loader) == []  # the trainer, at batch 10, sees the epoch done
    assert module.position.epoch == 0 and module.position.history  # not restarted
    state, consumed = _checkpoint(_module(data, 2), data, world=2, k=9)  # 6 of the 60 remain
    rest, plan = _resume(data, state, world=4, workers=1)  # a global batch is 12
    assert rest == [] and plan.total == plan.left_out == 6


def test_positions_that_cannot_continue_exactly_restart_the_epoch_with_a_warning(tmp_path):
    write_dataset(tmp_path, SIZES)
    data = str(tmp_path)
    state, _ = _checkpoint(_module(data, 2), data, world=2, k=3)
    old = {k: state["position"][k] for k in ("epoch", "batches", "raw", "skipped")}  # an older mmssl's
    resampled = dict(state["position"])
    spec = _module(data, 2, resampled=True, train_num_samples=64).build_stream(data, True, 0, 1).spec
    for saved, target, message in ((old, _module(data, 2).build_stream(data, True, 0, 2).spec, "does not record"),
                                   (resampled, spec, "resampled streams continue only")):
        position = StreamPosition()
        with pytest.warns(UserWarning, match=message):
            position.load_state_dict(saved, target)
        assert position.start(0, target).resume == {}  # from the epoch's beginning
    module = _module(data, 2, seed=1)
    with pytest.warns(UserWarning, match="data.seed=0, this run has data.seed=1"):
        module.load_state_dict(state)
    assert module.position.epoch == -1


class _Recorder(pl.LightningModule):
    """A one-parameter model that records, per epoch, the labels of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch["label"].tolist())
        return (self.weight - batch["image"].mean()) ** 2

    def configure_optimizers(self):
        # As the CLIP and MAE modules do for their schedules; with ``max_epochs`` this makes Lightning
        # open the training loader before it restores its loops (``current_epoch`` still 0).
        assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_elastic_resume_through_the_trainer_finishes_the_epoch_then_runs_whole_ones(tmp_path):
    every = write_dataset(tmp_path / "d", SIZES)
    data = str(tmp_path / "d")
    common = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=str(tmp_path))
    first = _Recorder()
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True)
    pl.Trainer(max_steps=5, callbacks=[save], **common).fit(first, datamodule=_module(data, 2, batch_size=4))
    resumed = _Recorder()  # saved on 2 workers x batch 4, resumed on 1 (num_workers=0) x batch 3
    trainer = pl.Trainer(max_epochs=3, **common)
    trainer.fit(resumed, datamodule=_module(data, 0, batch_size=3), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    epoch0 = first.seen[0] + resumed.seen[0]
    assert len(first.seen[0]) == 20 and len(resumed.seen[0]) == 42  # 44 remained: 14 batches, 2 left out
    assert len(set(epoch0)) == len(epoch0) == 62  # the rest of epoch 0, once
    for epoch in (1, 2):  # then whole epochs of 21 batches (the trainer reloaded the loader's length)
        assert len(resumed.seen[epoch]) == len(set(resumed.seen[epoch])) == 63 and set(resumed.seen[epoch]) <= set(
            every
        )
    assert trainer.global_step == 5 + 14 + 21 + 21


def test_a_same_topology_resume_through_the_trainer_sees_the_uninterrupted_batches(tmp_path):
    write_dataset(tmp_path / "d", SIZES)
    data = str(tmp_path / "d")
    common = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=str(tmp_path))
    whole = _Recorder()
    pl.Trainer(max_epochs=2, **common).fit(whole, datamodule=_module(data, 2, batch_size=4))
    first, resumed = _Recorder(), _Recorder()
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True)
    pl.Trainer(max_steps=5, callbacks=[save], **common).fit(first, datamodule=_module(data, 2, batch_size=4))
    pl.Trainer(max_epochs=2, **common).fit(resumed, datamodule=_module(data, 2, batch_size=4),
                                           ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert first.seen[0] + resumed.seen[0] == whole.seen[0] and resumed.seen[1] == whole.seen[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_from_the_last_batch_of_an_epoch_reads_the_next_epoch(tmp_path, workers):
    write_dataset(tmp_path / "d", SIZES)
    data = str(tmp_path / "d")
    common = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=str(tmp_path))
    whole = _Recorder()
    pl.Trainer(max_epochs=2, **common).fit(whole, datamodule=_module(data, workers, batch_size=4))
    first, resumed = _Recorder(), _Recorder()
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=16, save_last=True)  # 16 steps an epoch
    pl.Trainer(max_steps=16, callbacks=[save], **common).fit(first, datamodule=_module(data, workers, batch_size=4))
    state = read_checkpoint(str(tmp_path / "ckpt" / "last.ckpt"))
    before = torch.random.get_rng_state()
    pl.Trainer(max_epochs=2, **common).fit(resumed, datamodule=_module(data, workers, batch_size=4),
                                           ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert state["global_step"] == 16 and first.seen[0] == whole.seen[0]
    assert list(resumed.seen) == [1] and resumed.seen[1] == whole.seen[1]  # epoch 1, not epoch 0 again
    assert torch.equal(torch.random.get_rng_state(), before)  # opening loaders drew nothing from torch's RNG


def test_a_resume_in_a_later_epoch_continues_it_though_the_trainer_opens_the_loader_early(tmp_path):
    write_dataset(tmp_path / "d", SIZES)
    data = str(tmp_path / "d")
    common = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=str(tmp_path))
    whole = _Recorder()
    pl.Trainer(max_epochs=3, **common).fit(whole, datamodule=_module(data, 2, batch_size=4))
    first, resumed = _Recorder(), _Recorder()
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=21, save_last=True)  # step 5 of epoch 1
    pl.Trainer(max_steps=21, max_epochs=3, callbacks=[save], **common).fit(
        first, datamodule=_module(data, 2, batch_size=4)
    )
    pl.Trainer(max_epochs=3, **common).fit(resumed, datamodule=_module(data, 2, batch_size=4),
                                           ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert first.seen[1] + resumed.seen[1] == whole.seen[1] and resumed.seen[2] == whole.seen[2]
