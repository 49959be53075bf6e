"""Where tools/make_shards.py writes: never into its image folder, and an interrupted run's shards
are known as incomplete (inspect_shards says so) and replaced by --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tests.tools.test_make_shards import _images, _run


def test_make_shards_refuses_an_output_inside_its_image_folder(tmp_path, capsys):
    _images(tmp_path / "imgs")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (tmp_path / "imgs", tmp_path / "imgs" / "shards", tmp_path / "imgs" / "red_car"):
        assert _run("make_shards.py", "--data", str(tmp_path / "imgs"), "--output", str(out)) == 1
        err = capsys.readouterr().err
        assert f"--output '{out}' is inside --data '{tmp_path / 'imgs'}'" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_an_interrupted_make_shards_is_incomplete_and_overwrite_replaces_it(tmp_path, capsys):
    _images(tmp_path / "imgs")
    broken = tmp_path / "imgs" / "red_car" / "zzz.jpg"  # the last image in input order
    broken.write_bytes(b"not a jpeg")
    out = tmp_path / "shards"
    args = ["--data", str(tmp_path / "imgs"), "--output", str(out), "--shard-size", "4", "--resize", "20",
            "--no-shuffle"]
    assert _run("make_shards.py", *args) == 1  # re-encoding the 7th image fails: 1.tar holds 2 whole samples
    assert len(list((out / "train").glob("*.tar"))) == 2 and not (out / "train" / "sizes.json").exists()
    capsys.readouterr()
    assert _run("inspect_shards.py", "--data", str(out / "train")) == 1
    assert f"BAD {out / 'train'}: incomplete" in capsys.readouterr().out
    assert _run("make_shards.py", *args) == 1
    assert "interrupted run" in capsys.readouterr().err
    broken.unlink()
    assert _run("make_shards.py", *args, "--overwrite") == 0
    assert json.loads(Path(out, "train", "sizes.json").read_text()) == {"0.tar": 4, "1.tar": 2}
    assert not (out / "train" / "incomplete.json").exists()
    assert _run("inspect_shards.py", "--data", str(out / "train")) == 0
    Image.new("RGB", (4, 4)).save(out / "train" / "cover.png")  # not a shard: left alone
    assert _run("make_shards.py", *args, "--overwrite") == 0 and (out / "train" / "cover.png").exists()
