"""Image folders (``ROOT/<class>/<image>``) as training and validation data: split, epochs, resume,
bad files, and the real CLI on 2 processes with validation on."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from shard_helpers import count_tokenizer, image_bytes

from mmssl.cli import cli_main
from mmssl.data import folders
from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.pipeline import worker_batches
from mmssl.data.reading import Health, read_pieces
from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl

CLASSES = ("red_fox", "cat", "dog")


def write_folder(root: Path, per_class: int, start: int = 0) -> Path:
    """``root/<class>/<i>.jpg|png``: JPEG and PNG alternate; the class folders list in order."""
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            index = start + c * per_class + i
            fmt = ("jpg", "JPEG") if i % 2 == 0 else ("png", "PNG")
            (root / name / f"{index:04d}.{fmt[0]}").write_bytes(image_bytes(index, fmt[1]))
    (root / "README.txt").write_text("not an image, not a class")  # ignored
    return root


def _module(data, **kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=4, num_workers=2, image_size=8, shuffle_buffer=8, tokenizer=count_tokenizer)
    return ImageTextDataModule(train_data=data, **{**defaults, **kwargs})


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    folders._listing.cache_clear()
    monkeypatch.setattr(folders, "FOLDER_SHARD", 7)  # 3 x 10 images -> 5 virtual shards
    # The patched size is this process's: workers forked from it see it, but a fork server's
    # (MMSSL_WORKER_START=forkserver) import mmssl afresh and would read 256-image shards, so a
    # resumed epoch's planned samples of shards 1-4 would not exist there. These tests use fork.
    monkeypatch.setenv("MMSSL_WORKER_START", "fork")


def test_a_folder_is_read_as_virtual_shards_with_labels_and_captions(tmp_path):
    root = write_folder(tmp_path / "train", 10)
    urls = folders.folder_urls(str(root))
    assert len(urls) == 5 and all(u.startswith("imagefolder:") for u in urls)
    samples = [s for u in urls for _, s in folders.folder_samples(u)]
    assert len(samples) == 30 and len({s["__key__"] for s in samples}) == 30
    by_class = Counter((s["__key__"].split("/")[0], int(s["cls"])) for s in samples)
    assert by_class == {("red_fox", 2): 10, ("cat", 0): 10, ("dog", 1): 10}  # labels: sorted class names
    fox = next(s for s in samples if s["__key__"].startswith("red_fox"))
    assert fox["txt"] == b"a photo of a red fox."  # as tools/make_shards.py --folder writes captions
    assert sum("jpg" in s for s in samples) == sum("png" in s for s in samples) == 15
    # The fixed shuffle mixes classes inside each virtual shard (a class-ordered list would not).
    first = [int(s["cls"]) for _, s in folders.folder_samples(urls[0])]
    assert len(set(first)) > 1


def test_exact_epochs_on_two_ranks_read_no_image_twice(tmp_path):
    root = str(write_folder(tmp_path / "train", 10))
    module = _module(root)
    keys: Counter = Counter()
    batches = {}
    for rank in range(2):
        spec = module.build_stream(root, True, rank, 2).spec
        for worker in range(2):
            pieces = spec.plan(0).slots[rank * 2 + worker]  # what this worker reads this epoch
            keys.update(s["__key__"] for s in read_pieces(spec.urls, pieces, Health(0.1)))
            batches[rank, worker] = list(worker_batches(spec, module._decoder(True), 0, worker))
    # 30 images // (2 ranks x batch 4) = 3 batches per rank: 24 read once each, 6 (< 8) left out.
    assert set(keys.values()) == {1} and sum(keys.values()) == 24
    counts = [sum(len(b) for (r, _), b in batches.items() if r == rank) for rank in range(2)]
    assert counts == [3, 3]
    labels = [int(x) for b in batches.values() for batch in b for x in batch["label"]]
    assert len(labels) == 24 and set(labels) == {0, 1, 2}


def test_resume_mid_epoch_from_a_folder_continues_with_the_remainder(tmp_path):
    root = str(write_folder(tmp_path / "train", 10))

    def labels(module, loader, limit=None):
        out = []
        for batch in loader:
            out.append([int(x) for x in module.on_before_batch_transfer(batch, 0)["label"]])
            if len(out) == limit:
                break
        return out

    full_module = _module(root, batch_size=2)
    full = labels(full_module, full_module.train_dataloader())
    interrupted = _module(root, batch_size=2)
    head = labels(interrupted, interrupted.train_dataloader(), limit=4)
    resumed = _module(root, batch_size=2)
    resumed.load_state_dict(interrupted.state_dict())
    assert head + labels(resumed, resumed.train_dataloader()) == full and len(full) == 15


def test_bad_and_vanished_images_are_skipped_counted_and_named(tmp_path, caplog):
    root = write_folder(tmp_path / "train", 10)
    (root / "cat" / "0013.png").write_bytes(b"not a png")
    module = _module(str(root), num_workers=0, batch_size=2, max_bad_fraction=1.0)
    module.build_stream(str(root), True)  # lists the folder (cached, as the workers inherit it)
    os.remove(root / "dog" / "0022.jpg")  # gone between the listing and the read
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        for batch in module.train_dataloader():
            module.on_before_batch_transfer(batch, 0)
    lines = [r.getMessage() for r in caplog.records]
    assert any("'cat/0013'" in line and "unreadable png" in line for line in lines), lines
    assert any("dog/0022.jpg" in line for line in lines), lines
    assert module.position.skipped == 2


def test_a_folder_without_images_fails_naming_it(tmp_path):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no class sub-folders of images"):
        _module(str(tmp_path / "empty")).train_dataloader()


COLOURS = ((200, 30, 30), (30, 200, 30), (30, 30, 200))


def write_colour_folder(root: Path, per_class: int, seed: int) -> str:
    """A learnable folder: noisy squares whose colour is the class (PNG, lossless)."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(np.array(COLOURS[c]) + rng.integers(-60, 61, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
    return str(root)


def test_fine_tuning_from_image_folders_on_two_processes_validates_as_one(tmp_path):
    """``mmssl fit`` of an ImageClassifier with train and val image folders, 2 gloo processes,
    validation on (the 30 val images are one virtual shard: rank 1 validates nothing and still
    joins the metric reduction); one process validating the last checkpoint on the same folder
    gives the figures the 2-process run logged, and the run learned the colours."""
    train = write_colour_folder(tmp_path / "train", 32, 0)
    val = write_colour_folder(tmp_path / "val", 10, 1)
    common = [
        "--config", str(REPO / "configs/finetune/demo.yaml"), "--model.init_args.num_classes=3",
        "--model.init_args.image_size=16",
        '--model.init_args.model_kwargs={"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2}',
        "--data.init_args.batch_size=8", "--data.init_args.num_workers=1", "--data.init_args.image_key=png",
        f"--data.init_args.train_data={train}", f"--data.init_args.val_data={val}",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
    ]
    out = run_mmssl(["fit", *common, "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT,
                     "--trainer.max_epochs=4", "--model.init_args.blr=0.03"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "data: exact epochs over 2 ranks" in out.stdout  # 96 images // (2 x 8) = 6 steps an epoch
    run = tmp_path / "runs" / "version_0"
    two = last_metrics(run)
    assert two["val/top1"] >= 0.6, two  # chance is 1/3
    one = cli_main(["validate", *common, f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}"]).trainer.callback_metrics
    for key in ("val/top1", "val/loss"):
        assert float(one[key]) == pytest.approx(two[key], rel=1e-5), key
