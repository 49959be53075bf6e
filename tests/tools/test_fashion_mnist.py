"""tools/fashion_mnist.py on tiny idx files written here (never the real data set)."""

import gzip
import importlib.util
import io
import json
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmssl.data.label_files import read_classnames, read_templates
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fashion_mnist_tool", REPO / "tools/fashion_mnist.py")
fm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fm)


def _idx(array: np.ndarray) -> bytes:
    """The idx encoding of a uint8 array: 0, 0, dtype 0x08, ndim, big-endian dims, data."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


@pytest.fixture
def source(tmp_path):
    """A 7-train / 3-test Fashion-MNIST look-alike: train gzipped (as Debian ships it), test raw."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "idx"
    folder.mkdir()
    data = {}
    for prefix, n, opener in (("train", 7, gzip.open), ("t10k", 3, open)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        suffix = ".gz" if opener is gzip.open else ""
        with opener(folder / f"{prefix}-images-idx3-ubyte{suffix}", "wb") as f:
            f.write(_idx(images))
        with opener(folder / f"{prefix}-labels-idx1-ubyte{suffix}", "wb") as f:
            f.write(_idx(labels))
        data[prefix] = (images, labels)
    return folder, data


def _samples(shard: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return out


def test_read_idx_round_trips_gzip_and_raw(source):
    folder, data = source
    assert np.array_equal(fm.read_idx(str(folder / "train-images-idx3-ubyte.gz")), data["train"][0])
    assert np.array_equal(fm.read_idx(str(folder / "t10k-labels-idx1-ubyte")), data["t10k"][1])


def test_read_idx_rejects_bad_files_naming_them(tmp_path):
    bad = tmp_path / "bad-idx1-ubyte"
    bad.write_bytes(b"\x1f\x8bnot idx")
    with pytest.raises(ValueError, match="bad-idx1-ubyte.*not an idx"):
        fm.read_idx(str(bad))
    short = tmp_path / "short-idx1-ubyte"
    short.write_bytes(_idx(np.zeros(5, np.uint8))[:-2])
    with pytest.raises(ValueError, match="short-idx1-ubyte.*file holds 3"):
        fm.read_idx(str(short))


def test_missing_source_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        fm.convert(str(tmp_path), str(tmp_path / "out"))


def test_convert_writes_clip_benchmark_layout_with_exact_pixels(source, tmp_path):
    folder, data = source
    out = tmp_path / "out"
    assert fm.main(["--data", str(folder), "--output", str(out), "--shard-size", "4"]) == 0
    result = {split: json.loads((out / split / "sizes.json").read_text()) for split in ("train", "test")}
    assert result == {"train": {"0.tar": 4, "1.tar": 3}, "test": {"0.tar": 3}}
    # clip_benchmark's wds/ layout: class names and templates at the root, nshards.txt per split.
    assert (out / "classnames.txt").read_text().splitlines() == list(fm.CLASSNAMES)
    assert (out / "zeroshot_classification_templates.txt").read_text().splitlines() == list(fm.ZERO_SHOT_TEMPLATES)
    assert [(out / s / "nshards.txt").read_text().strip() for s in ("train", "test")] == ["2", "1"]
    for split, prefix in (("train", "train"), ("test", "t10k")):
        split_dir = out / split
        assert read_classnames(str(split_dir)) == list(fm.CLASSNAMES)
        assert all("{c}" in t for t in read_templates(str(split_dir)))
        samples = {}
        for shard in (split_dir / f"{i}.tar" for i in range(len(result[split]))):
            samples.update(_samples(shard))
        images, labels = data[prefix]
        assert len(samples) == len(images)
        for i, key in enumerate(sorted(samples)):
            sample = samples[key]
            assert set(sample) == {"png", "txt", "cls"}
            assert np.array_equal(np.array(Image.open(io.BytesIO(sample["png"]))), images[i])  # lossless
            assert int(sample["cls"]) == labels[i]
            assert fm.CLASSNAMES[labels[i]] in sample["txt"].decode()


def test_convert_is_deterministic_and_limit_applies(source, tmp_path):
    folder, _ = source
    fm.convert(str(folder), str(tmp_path / "a"), shard_size=4, limit=5)
    fm.convert(str(folder), str(tmp_path / "b"), shard_size=4, limit=5)
    for rel in ("train/0.tar", "train/1.tar", "test/0.tar"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    assert json.loads((tmp_path / "a/train/sizes.json").read_text()) == {"0.tar": 4, "1.tar": 1}


def test_output_reads_back_through_mmssl_labeled_loader(source, tmp_path):
    folder, data = source
    fm.convert(str(folder), str(tmp_path / "out"), shard_size=4)
    loader = labeled_loader(str(tmp_path / "out/test"), eval_transform(28), batch_size=8, image_key="png")
    (batch,) = list(loader)
    assert batch["image"].shape == (3, 3, 28, 28)
    assert batch["label"].tolist() == data["t10k"][1].tolist()


@pytest.fixture
def fashion_cwd(source, tmp_path, monkeypatch):
    """A working folder where the configs' relative paths (data/fashion_mnist, configs/) resolve."""
    folder, _ = source
    work = tmp_path / "work"
    work.mkdir()
    fm.convert(str(folder), str(work / "data/fashion_mnist"), shard_size=4)
    (work / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize("recipe, checks", [
    ("mae_vit_patch4", {"train/loss"}),
    ("clip_tiny", {"train/loss", "val/zero_shot_top1"}),
    ("clip_mlm_tiny", {"train/loss", "train/mlm_loss", "train/itm_loss", "val/zero_shot_top1", "val/mlm_top1"}),
])
def test_fashion_mnist_configs_run_end_to_end(fashion_cwd, recipe, checks):
    from mmssl.cli import main

    main([
        "fit", "--config", f"configs/fashion_mnist/{recipe}.yaml",
        "--data.init_args.batch_size=3", "--data.init_args.num_workers=0",
        "--trainer.max_steps=2", "--trainer.max_time=null", "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
        "--trainer.default_root_dir=runs", "--trainer.enable_progress_bar=false",
    ])
    (run,) = (fashion_cwd / "runs").glob("version_*")
    logged = set(open(run / "metrics.csv").readline().strip().split(","))
    assert checks <= logged, logged
