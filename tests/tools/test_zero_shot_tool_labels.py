"""tools/zero_shot.py on the labelled sets users have: an image folder without classnames.txt,
shards whose cls values are bad (skipped, counted, named), a classnames.txt with a blank line."""

import json
import logging
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from mmssl.models.clip import CLIP
from tests.data.image_helpers import write_image_folder
from tests.data.shard_helpers import sample_members, write_tar

REPO = Path(__file__).resolve().parents[2]


def zero_shot(args: list[str], monkeypatch, tmp_path: Path) -> dict:
    """``tools/zero_shot.py ARGS`` in-process: the report it writes to ``--output-json``."""
    out = tmp_path / "zero_shot.json"
    monkeypatch.setattr(sys, "argv", ["zero_shot.py", *args, "--output-json", str(out)])
    assert runpy.run_path(str(REPO / "tools" / "zero_shot.py"), run_name="zero_shot")["main"]() == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def open_clip_file(tiny_clip_json, tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("clip") / "open_clip.pt"
    torch.manual_seed(0)
    torch.save(CLIP(tiny_clip_json).model.state_dict(), path)
    return ["--ckpt", str(path), "--model", tiny_clip_json]


def test_zero_shot_tool_on_an_image_folder_names_classes_after_its_folders(open_clip_file, tmp_path, monkeypatch):
    # Before: "find_classes() missing 1 required positional argument" at start-up.
    folder = write_image_folder(tmp_path / "set", ["cat", "dog", "red_fox"], 2)
    report = zero_shot([*open_clip_file, "--data", str(folder)], monkeypatch, tmp_path)
    assert (report["num_classes"], report["num_samples"], report["skipped"]) == (3, 6, 0)
    assert 0.0 <= report["top1"] <= 1.0


def test_zero_shot_tool_skips_bad_labels_and_refuses_a_shifted_class_list(open_clip_file, tmp_path, monkeypatch, caplog,
                                                                          capsys):
    # Before: the overflowing cls crashed batch stacking without naming shard or key.
    members = sample_members(0, label=0) + sample_members(1, label=1)
    members += [m for m in sample_members(2) if not m[0].endswith(".cls")] + [
        ("s00002.cls", b"99999999999999999999999")
    ]
    write_tar(tmp_path / "00000.tar", members)
    (tmp_path / "classnames.txt").write_text("cat\ndog\n")
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        report = zero_shot([*open_clip_file, "--data", str(tmp_path)], monkeypatch, tmp_path)
    assert (report["num_samples"], report["skipped"]) == (2, 1)
    assert any("'s00002'" in r.getMessage() and "00000.tar" in r.getMessage() and "overflows int64" in r.getMessage()
               for r in caplog.records)
    (tmp_path / "classnames.txt").write_text("cat\n\ndog\n")
    monkeypatch.setattr(sys, "argv", ["zero_shot.py", *open_clip_file, "--data", str(tmp_path)])
    assert runpy.run_path(str(REPO / "tools" / "zero_shot.py"), run_name="zero_shot")["main"]() == 1
    assert re.fullmatch(r"zero_shot: .*classnames.txt, line 2: blank line.*\n", capsys.readouterr().err)
