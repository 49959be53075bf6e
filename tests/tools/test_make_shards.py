"""tools/make_shards.py and tools/inspect_shards.py on tiny folders and tables."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.pipeline import worker_batches
from mmssl.data.shards import inspect_shards

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(tool: str, *args: str) -> int:
    argv, sys.argv = sys.argv, [tool, *args]
    try:
        runpy.run_path(str(TOOLS / tool), run_name="__main__")
    except SystemExit as exit_info:
        return int(exit_info.code or 0)
    finally:
        sys.argv = argv
    return 0


def _images(folder: Path) -> None:
    for c, cls in enumerate(("red_car", "blue_boat")):
        (folder / cls).mkdir(parents=True)
        for i in range(3):
            fmt, ext = ("PNG", "png") if i == 0 else ("JPEG", "jpg")
            Image.new("RGB", (40, 30), (200 * (1 - c), 0, 200 * c)).save(folder / cls / f"{i}.{ext}", format=fmt)


def test_make_shards_from_class_folders_then_train_on_them(tmp_path, capsys):
    _images(tmp_path / "imgs")
    out = tmp_path / "shards"
    assert _run("make_shards.py", "--data", str(tmp_path / "imgs"), "--output", str(out),
                "--shard-size", "4", "--resize", "20", "--template", "a photo of a {c}.") == 0
    # A clip_benchmark wds/ set: OUTPUT/train/{0,1}.tar + nshards.txt, class names at OUTPUT.
    assert json.loads((out / "train/sizes.json").read_text()) == {"0.tar": 4, "1.tar": 2}
    assert (out / "train/nshards.txt").read_text().strip() == "2"
    assert (out / "classnames.txt").read_text().split("\n")[:2] == ["blue boat", "red car"]
    assert (out / "zeroshot_classification_templates.txt").read_text().strip() == "a photo of a {c}."
    out = out / "train"
    good, problems, shown, warnings = inspect_shards(str(out))
    assert (good, problems, warnings) == (6, [], [])
    assert shown[0]["txt"] == {"0": "a photo of a blue boat.", "1": "a photo of a red car."}[shown[0]["cls"]]
    module = ImageTextDataModule(train_data=str(out), batch_size=2, num_workers=0, image_size=8)
    labels = [int(x) for b in module.train_dataloader() for x in b["label"]]
    assert sorted(labels) == [0, 0, 0, 1, 1, 1]


def test_make_shards_from_table_and_inspect_reports_bad(tmp_path, capsys):
    _images(tmp_path / "imgs")
    table = tmp_path / "pairs.tsv"
    table.write_text("path\tcaption\nimgs/red_car/1.jpg\ta red car\nimgs/blue_boat/2.jpg\ta blue boat\n")
    assert _run("make_shards.py", "--data", str(table), "--output", str(tmp_path / "s")) == 0
    assert json.loads((tmp_path / "s" / "sizes.json").read_text()) == {"00000.tar": 2}
    (tmp_path / "s" / "00001.tar").write_bytes(b"junk" * 10)
    assert _run("inspect_shards.py", "--data", str(tmp_path / "s")) == 1
    out = capsys.readouterr().out
    assert "2 good samples, 1 problems" in out and "BAD" in out and "00001.tar" in out


def _class_folder(folder: Path, classes: int = 10, per_class: int = 20) -> None:
    for c in range(classes):
        (folder / f"class_{c:02d}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (c * 20, i * 10, 0)).save(folder / f"class_{c:02d}" / f"{i}.png")


def _distinct_labels_per_batch(shards: Path) -> float:
    """Mean distinct labels in the batches of 2 simulated ranks x 2 workers (batch 8, buffer 8)."""
    module = ImageTextDataModule(train_data=str(shards), batch_size=8, num_workers=2, image_size=8, shuffle_buffer=8)
    counts = []
    for rank in range(2):
        stream = module.build_stream(str(shards), True, rank, 2)
        for worker in range(2):
            counts += [len(set(b["label"].tolist())) for b in worker_batches(stream.spec, stream.decoder, 0, worker)]
    return float(np.mean(counts))


def test_shards_of_a_class_ordered_folder_mix_classes_in_every_batch(tmp_path, capsys):
    _class_folder(tmp_path / "imgs")
    for name, extra in (("mixed", []), ("ordered", ["--no-shuffle"])):  # --folder: the old spelling of --data
        assert _run("make_shards.py", "--folder", str(tmp_path / "imgs"), "--output", str(tmp_path / name),
                    "--shard-size", "20", *extra) == 0
    labels = np.repeat(np.arange(10), 20)
    rng = np.random.default_rng(0)  # a fully shuffled stream of the same labels, cut into batches of 8
    shuffled = np.mean([len(set(rng.permutation(labels)[i:i + 8])) for _ in range(50) for i in range(0, 200, 8)])
    assert _distinct_labels_per_batch(tmp_path / "mixed/train") > 0.85 * shuffled
    assert _distinct_labels_per_batch(tmp_path / "ordered/train") < 0.6 * shuffled  # what the shuffle fixes
    # inspect_shards names the class-ordered shards and is silent on the mixed ones.
    assert inspect_shards(str(tmp_path / "mixed/train"))[3] == []
    assert _run("inspect_shards.py", "--data", str(tmp_path / "ordered/train")) == 0
    out = capsys.readouterr().out
    assert out.count("WARNING") == 20 and "/3.tar: 20 of 20 samples have the label 3" in out


def test_make_shards_refuses_a_folder_of_someone_elses_shards(tmp_path, capsys):
    _images(tmp_path / "imgs")
    out = tmp_path / "shards"
    (out / "train").mkdir(parents=True)
    (out / "train" / "0.tar").write_bytes(b"the user's own shard")
    (out / "train" / "mine.tar").write_bytes(b"another")
    args = ["--data", str(tmp_path / "imgs"), "--output", str(out), "--shard-size", "4"]
    assert _run("make_shards.py", *args) == 1
    assert f"{out / 'train'} already holds shards" in capsys.readouterr().err
    assert (out / "train" / "0.tar").read_bytes() == b"the user's own shard"
    # --overwrite replaces only the shards an earlier run listed in sizes.json: never a foreign one.
    assert _run("make_shards.py", *args, "--overwrite") == 1
    assert "not listed in its sizes.json" in capsys.readouterr().err and (out / "train" / "mine.tar").exists()
    (out / "train" / "mine.tar").unlink()
    (out / "train" / "0.tar").unlink()
    assert _run("make_shards.py", *args) == 0
    assert _run("make_shards.py", *args, "--shard-size", "6", "--overwrite") == 0  # its own run: replaced
    assert sorted(p.name for p in (out / "train").glob("*.tar")) == ["0.tar"]


def test_inspect_shards_checks_sizes_json_against_the_shards_and_labels_in_range(tmp_path, capsys):
    from tests.data.shard_helpers import sample_members, write_dataset, write_tar

    write_dataset(tmp_path / "a", [3, 3])
    (tmp_path / "a" / "sizes.json").write_text(json.dumps({"00000.tar": 1000, "00001.tar": 2}))  # too many, too few
    assert _run("inspect_shards.py", str(tmp_path / "a")) == 1  # the old positional form, still accepted
    out = capsys.readouterr().out
    assert "00000.tar: holds 3 samples" in out and "lists 1000" in out
    assert "00001.tar: holds 3 samples" in out and "lists 2" in out
    (tmp_path / "a" / "sizes.json").write_text(json.dumps({"00000.tar": -3, "00001.tar": 3}))
    assert _run("inspect_shards.py", "--data", str(tmp_path / "a")) == 1
    assert "non-negative integer" in capsys.readouterr().out
    members = sample_members(0) + sample_members(1, label=99999999999999999999999)
    members += [(n, b"cat" if n.endswith(".cls") else d) for n, d in sample_members(2)]
    members += sample_members(3, label=-1)
    (tmp_path / "b").mkdir()
    write_tar(tmp_path / "b" / "00000.tar", members)
    good, problems, _, _ = inspect_shards(str(tmp_path / "b"))
    assert good == 1 and len(problems) == 3
    assert "'s00001'" in problems[0] and "overflows int64: 99999999999999999999999" in problems[0]
    assert "'s00002'" in problems[1] and "not an integer" in problems[1]
    assert "'s00003'" in problems[2] and "negative: -1" in problems[2]


def test_fashion_mnist_writer_refuses_a_folder_of_someone_elses_shards(tmp_path):
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("fashion_mnist_tool", TOOLS / "fashion_mnist.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    folder = tmp_path / "train"
    folder.mkdir()
    (folder / "0.tar").write_bytes(b"the user's own shard")
    images, labels = np.zeros((3, 28, 28), np.uint8), np.array([0, 1, 2])
    with pytest.raises(FileExistsError, match=f"{folder} already holds shards"):
        fm.write_split(images, labels, folder, 2, 0)
    with pytest.raises(FileExistsError, match="not listed in its sizes.json"):
        fm.write_split(images, labels, folder, 2, 0, overwrite=True)
    assert (folder / "0.tar").read_bytes() == b"the user's own shard"
