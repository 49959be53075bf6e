"""Exports through symbolic links are written where the link points (the link stays, nothing stray
is left beside either), and replacing an earlier export folder never leaves ``--output`` missing."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
from pathlib import Path

import pytest
import torch

from mmssl.export import paths

REPO = Path(__file__).resolve().parents[2]


def _export(*argv: str) -> tuple[int, str]:
    main = runpy.run_path(str(REPO / "tools" / "export.py"), run_name="test")["main"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def clip_ckpt(tmp_path_factory, tiny_clip_json) -> Path:
    from mmssl.models.clip import CLIP

    torch.manual_seed(0)
    module = CLIP(tiny_clip_json)
    path = tmp_path_factory.mktemp("clip") / "last.ckpt"
    hparams = {**dict(module.hparams), "_class_path": "mmssl.models.clip.CLIP"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


def _hidden(*folders: Path) -> list[str]:
    return [str(p) for f in folders for p in f.iterdir() if p.name.startswith(".")]


def test_a_folder_export_through_a_link_is_written_where_it_points(tmp_path, clip_ckpt):
    links, disk = tmp_path / "links", tmp_path / "disk"
    links.mkdir(), disk.mkdir()
    (disk / "v1").mkdir()
    (links / "latest").symlink_to(disk / "v1")  # a link to an empty folder
    (links / "dangling").symlink_to(disk / "v2")  # a link to nothing yet
    for link in ("latest", "dangling"):
        args = ["--ckpt", str(clip_ckpt), "--format", "open_clip_hf", "--output", str(links / link)]
        assert _export(*args) == (0, "")
        assert _export(*args, "--overwrite") == (0, "")  # an earlier export replaced through the link
        assert (links / link).is_symlink()
        target = disk / ("v1" if link == "latest" else "v2")
        assert sorted(p.name for p in target.iterdir()) == ["open_clip_config.json", "open_clip_model.safetensors"]
    assert sorted(p.name for p in disk.iterdir()) == ["v1", "v2"] and not _hidden(links, disk)
    (disk / "file").write_text("x")
    (links / "to_file").symlink_to(disk / "file")
    code, err = _export("--ckpt", str(clip_ckpt), "--format", "open_clip_hf", "--output", str(links / "to_file"))
    assert (code, err) == (1, f"export: --output '{links / 'to_file'}' (a link to '{disk / 'file'}') is a file; "
                              "this format writes a folder\n")


def test_a_file_export_through_a_link_is_written_where_it_points(tmp_path, clip_ckpt):
    (tmp_path / "clip.pth").symlink_to(tmp_path / "store" / "clip_v1.pth")  # dangling: its folder is not there
    args = ["--ckpt", str(clip_ckpt), "--format", "open_clip", "--output", str(tmp_path / "clip.pth")]
    assert _export(*args) == (0, "")
    assert (tmp_path / "clip.pth").is_symlink() and (tmp_path / "store" / "clip_v1.pth").is_file()
    code, err = _export(*args)
    assert (code, err) == (1, f"export: --output '{tmp_path / 'clip.pth'}' (a link to "
                              f"'{tmp_path / 'store' / 'clip_v1.pth'}') exists: pass --overwrite to replace it\n")
    assert _export(*args, "--overwrite") == (0, "")
    assert (tmp_path / "clip.pth").is_symlink() and not _hidden(tmp_path, tmp_path / "store")


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


def _writer(text: str):
    def write(folder: str) -> dict:
        for name in ("config.json", "model.safetensors"):
            Path(folder, name).write_text(text)
        return {}
    return write


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_a_kill_at_any_step_of_replacing_an_export_folder_leaves_the_old_or_the_new_one_whole(tmp_path, monkeypatch):
    if not paths.exchange(str(tmp_path), str(tmp_path)):
        pytest.skip("this system or file system cannot exchange two paths in one step")
    out = tmp_path / "out"
    paths.write_folder(str(out), _writer("old"))
    steps: list[str] = []

    def step(name: str, real):
        def wrapped(*args, **kwargs):
            steps.append(name)
            if len(steps) == kill_at:
                raise Killed(name)
            return real(*args, **kwargs)
        return wrapped

    for kill_at in range(1, 6):
        steps.clear()
        with monkeypatch.context() as m:
            m.setattr(paths.os, "replace", step("replace", os.replace))
            m.setattr(paths, "exchange", step("exchange", paths.exchange))
            m.setattr(paths.shutil, "rmtree", step("rmtree", shutil.rmtree))
            try:
                paths.write_folder(str(out), _writer(f"new {kill_at}"))
            except Killed:
                pass
        assert _files(out) in ({"config.json": "old", "model.safetensors": "old"},
                               {"config.json": f"new {kill_at}", "model.safetensors": f"new {kill_at}"}), steps
        paths.write_folder(str(out), _writer("old"))  # the next write clears what a kill left


def test_without_an_exchange_a_failed_second_rename_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    paths.write_folder(str(out), _writer("old"))
    monkeypatch.setattr(paths, "exchange", lambda a, b: False)
    paths.write_folder(str(out), _writer("new"))  # two renames, the earlier folder set aside in between
    assert _files(out) == {"config.json": "new", "model.safetensors": "new"} and sorted(os.listdir(tmp_path)) == ["out"]
    replace = os.replace
    for failing in (1, 2):  # setting the earlier folder aside fails, or putting the new one in its place
        calls = []

        def fails(src, dst):
            calls.append(dst)
            if len(calls) == failing:
                raise OSError(5, "Input/output error", src)
            return replace(src, dst)

        with monkeypatch.context() as m:
            m.setattr(paths.os, "replace", fails)
            with pytest.raises(OSError, match="Input/output error"):
                paths.write_folder(str(out), _writer("newer"))
        assert _files(out) == {"config.json": "new", "model.safetensors": "new"}
        assert sorted(os.listdir(tmp_path)) == ["out"]
