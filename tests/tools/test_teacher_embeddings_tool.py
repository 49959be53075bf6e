"""tools/teacher_embeddings.py's folder: an interrupted --overwrite never leaves the side files of
two teachers under one manifest, and stored embeddings are refused for shards they were not
computed from."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest
import torch

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.demo import ensure_demo_data
from mmssl.data.teacher_embeddings import MANIFEST, TeacherEmbeddings
from mmssl.export import paths
from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]


def _tool(*argv: str) -> int:
    return runpy.run_path(str(REPO / "tools" / "teacher_embeddings.py"), run_name="test")["main"](list(argv))


def _teacher(path: Path, seed: int, config: str) -> Path:
    torch.manual_seed(seed)
    module = CLIP(config)
    hparams = {**dict(module.hparams), "_class_path": "mmssl.models.clip.CLIP"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_clip_json) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("teachers")
    return _teacher(folder / "a.ckpt", 3, tiny_clip_json), _teacher(folder / "b.ckpt", 4, tiny_clip_json)


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs in the process (no tool error handling)."""


# 4 side files are renamed into place, then the swap: one exchange of the two folders, or, where the
# system cannot exchange them, two renames (the earlier folder aside, the new one in).
@pytest.mark.parametrize("fail_at", [3, 6])
def test_an_interrupted_overwrite_never_mixes_two_teachers(tmp_path, tiny_demo, teachers, monkeypatch, fail_at):
    train, out = os.path.dirname(tiny_demo.train), tmp_path / "emb"
    common = ["--data", train, "--output", str(out), "--batch-size", "16", "--num-workers", "0"]
    assert _tool("--ckpt", str(teachers[0]), *common) == 0
    first = _contents(out)
    calls = []
    replace = os.replace
    if fail_at == 6:
        monkeypatch.setattr(paths, "exchange", lambda a, b: False)

    def killed_at(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise Killed(f"rename {len(calls)}")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at)
    with pytest.raises(Killed):
        _tool("--ckpt", str(teachers[1]), "--overwrite", *common)
    monkeypatch.undo()
    if out.exists():  # the first teacher's folder, every file as it was
        assert _contents(out) == first
    else:  # killed inside the swap: nothing to train on, and the error says where the earlier folder is
        with pytest.raises(FileNotFoundError, match=r"teacher\.json.*set the earlier folder aside as .*\.emb\.old\."):
            TeacherEmbeddings(str(out))
    # A rerun replaces whatever was left, and the folder is the second teacher's throughout.
    assert _tool("--ckpt", str(teachers[1]), "--overwrite", *common) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["teacher"] == str(teachers[1])
    changed = [n for n, data in first.items() if n.endswith(".npz") and (out / n).read_bytes() != data]
    assert len(changed) == 4


def test_embeddings_are_refused_for_other_shards_of_the_same_names(tmp_path, tiny_demo, teachers):
    """Two demo sets of another seed: the same shard names, keys and (padded tar) sizes, other samples."""
    train, out = os.path.dirname(tiny_demo.train), tmp_path / "emb"
    other = ensure_demo_data(str(tmp_path / "other"), num_train=64, num_val=32, shard_size=16, image_size=32, seed=1)
    other_train = os.path.dirname(other.train)
    assert sorted(os.listdir(other_train)) == sorted(os.listdir(train))
    assert _tool("--ckpt", str(teachers[0]), "--data", train, "--output", str(out), "--batch-size", "16",
                 "--num-workers", "0") == 0

    def setup(data: str) -> None:
        ImageTextDataModule(train_data=data, batch_size=8, num_workers=0, image_size=32,
                            teacher_embeddings=str(out)).setup("fit")

    setup(train)  # the shards they were computed from
    with pytest.raises(ValueError, match=rf"{out / MANIFEST}.* another shard named '0.tar'.*{other_train}/0.tar"):
        setup(other_train)
