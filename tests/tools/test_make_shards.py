"""tools/make_shards.py and tools/inspect_shards.py on tiny folders and tables."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from PIL import Image

from mmssl.data.shards import inspect_shards
from mmssl.data.webdataset import ImageTextDataModule

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
    assert _run("make_shards.py", "--folder", str(tmp_path / "imgs"), "--output", str(out),
                "--shard-size", "4", "--resize", "20", "--template", "a photo of a {c}.") == 0
    assert json.loads((out / "sizes.json").read_text()) == {"00000.tar": 4, "00001.tar": 2}
    assert (out / "classnames.txt").read_text().split("\n")[:2] == ["blue boat", "red car"]
    good, problems, shown = inspect_shards(str(out))
    assert (good, problems) == (6, [])
    assert shown[0]["txt"] == "a photo of a blue boat." and shown[0]["cls"] == "0"
    module = ImageTextDataModule(train_data=str(out), batch_size=2, num_workers=0, image_size=8)
    labels = [int(x) for b in module.train_dataloader() for x in b["label"]]
    assert sorted(labels) == [0, 0, 0, 1, 1, 1]


def test_make_shards_from_table_and_inspect_reports_bad(tmp_path, capsys):
    _images(tmp_path / "imgs")
    table = tmp_path / "pairs.tsv"
    table.write_text("path\tcaption\nimgs/red_car/1.jpg\ta red car\nimgs/blue_boat/2.jpg\ta blue boat\n")
    assert _run("make_shards.py", "--table", str(table), "--output", str(tmp_path / "s")) == 0
    assert json.loads((tmp_path / "s" / "sizes.json").read_text()) == {"00000.tar": 2}
    (tmp_path / "s" / "00001.tar").write_bytes(b"junk" * 10)
    assert _run("inspect_shards.py", str(tmp_path / "s")) == 1
    out = capsys.readouterr().out
    assert "2 good samples, 1 problems" in out and "BAD" in out and "00001.tar" in out
