"""The scoring tools name what is wrong with their inputs in one line, before a model loads: a
``--data`` that names nothing, an export folder where a Lightning checkpoint is needed, a JSON file
given as ``--ckpt``."""

from __future__ import annotations

import json

import pytest
import torch

from mmssl.tools import linear_probe, masked_words, zero_shot


def _one_line(capsys, tool, argv: list[str]) -> str:
    assert tool.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


def test_zero_shot_on_a_data_folder_that_does_not_exist_says_so(tmp_path, capsys):
    missing = str(tmp_path / "nonexistent")
    err = _one_line(capsys, zero_shot, ["--ckpt", str(tmp_path / "none.ckpt"), "--data", missing])
    assert f"--data {missing!r}: no such file or folder" in err and "classnames" not in err


def test_probe_names_the_missing_split(tmp_path, capsys):
    err = _one_line(capsys, linear_probe, ["--ckpt", "x.ckpt", "--train-data", str(tmp_path),
                                           "--val-data", str(tmp_path / "val")])
    assert f"--val-data {str(tmp_path / 'val')!r}: no such file or folder" in err


def test_masked_words_on_an_export_folder_says_it_is_one(tmp_path, capsys):
    folder = tmp_path / "timm_export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    err = _one_line(capsys, masked_words, ["--ckpt", str(folder), "--data", str(tmp_path)])
    assert f"--ckpt {str(folder)!r} is a timm export folder" in err and "no file at" not in err


@pytest.mark.parametrize("tool", [zero_shot, masked_words])
def test_a_json_file_given_as_a_checkpoint_is_named_not_a_checkpoint(tmp_path, capsys, tool):
    config = tmp_path / "clip_tiny.json"
    config.write_text(json.dumps({"embed_dim": 64, "vision_cfg": {}}))
    err = _one_line(capsys, tool, ["--ckpt", str(config), "--data", str(tmp_path)])
    assert f"--ckpt {str(config)!r} is not a checkpoint: it is a JSON file" in err
    assert "pickle" not in err and "weights_only" not in err


def test_checkpoint_files_are_not_refused_by_their_first_bytes(tmp_path):
    from safetensors.torch import save_file

    from mmssl.evaluation.encoders import not_a_checkpoint

    torch.save({"w": torch.zeros(2)}, tmp_path / "zip.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    for name in ("zip.pt", "legacy.pt", "w.safetensors"):
        assert not_a_checkpoint(str(tmp_path / name)) is None, name
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert not_a_checkpoint(str(tmp_path / "empty.ckpt")) == "the file is empty"
