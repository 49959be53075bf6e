"""A full disk while an export or stored teacher embeddings are written: one line naming the output
and the cause (exit 1, no traceback), the earlier file or folder there whole, nothing partial beside it.

The fault is real: strace fails every ``write`` of the tool's process with ENOSPC once the tool
starts (``tests.checkpoints.test_checkpoint_atomic._fork_under_strace``); the tool's stderr line is kept in
memory and handed back with ``pwrite``, which the injection leaves alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
from pathlib import Path

import pytest
import torch

from tests.checkpoints.test_checkpoint_atomic import _fork_under_strace, _strace

REPO = Path(__file__).resolve().parents[2]
FULL = ["-e", "trace=write", "-e", "inject=write:error=ENOSPC"]


def _tool(name: str):
    return runpy.run_path(str(REPO / "tools" / f"{name}.py"), run_name="test")["main"]


def _on_a_full_disk(tmp_path: Path, name: str, *argv: str) -> tuple[int, str]:
    """``tools/NAME.py ARGV`` in a fork whose writes all fail with ENOSPC: (exit status, stderr)."""
    main, report = _tool(name), tmp_path / "report.json"

    def body() -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(list(argv))
        fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.pwrite(fd, json.dumps([code, err.getvalue()]).encode(), 0)
        os.close(fd)

    _strace()
    assert _fork_under_strace(FULL, body, timeout=120) == 0
    code, err = json.loads(report.read_text())
    report.unlink()
    return code, err


def _contents(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) and its bytes."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clip_ckpt(tmp_path_factory, tiny_clip_json) -> Path:
    from mmssl.models.clip import CLIP

    torch.manual_seed(0)
    module = CLIP(tiny_clip_json)
    path = tmp_path_factory.mktemp("clip") / "last.ckpt"
    hparams = {**dict(module.hparams), "_class_path": "mmssl.models.clip.CLIP"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


@pytest.mark.parametrize("format,name", [("open_clip", "clip.pth"), ("open_clip", "clip.safetensors"),
                                         ("open_clip_hf", "clip_hub")])
def test_an_export_on_a_full_disk_names_the_output_and_keeps_the_earlier_one(tmp_path, clip_ckpt, format, name):
    out = tmp_path / "exports" / name
    args = ["--ckpt", str(clip_ckpt), "--format", format, "--output", str(out)]
    assert _tool("export")(args) == 0
    before = _contents(out)
    code, err = _on_a_full_disk(tmp_path, "export", *args, "--overwrite")
    kind = "folder" if format == "open_clip_hf" else "file"
    assert (code, err) == (1, f"export: {out}: could not write it (No space left on device); the earlier {kind} "
                              "there is unchanged, and no partial one is left\n")
    assert _contents(out) == before
    assert sorted(os.listdir(out.parent)) == [name]  # no temporary file or folder beside it
    code, err = _on_a_full_disk(tmp_path, "export", "--ckpt", str(clip_ckpt), "--format", format,
                                "--output", str(tmp_path / "exports" / f"new_{name}"))
    assert (code, err) == (1, f"export: {tmp_path / 'exports' / f'new_{name}'}: could not write it (No space left "
                              f"on device); no {kind} was written, and no partial one is left\n")
    assert sorted(os.listdir(out.parent)) == [name]


def test_teacher_embeddings_on_a_full_disk_name_the_output_and_keep_the_earlier_ones(tmp_path, tiny_demo, clip_ckpt):
    out = tmp_path / "emb"
    args = ["--ckpt", str(clip_ckpt), "--data", os.path.dirname(tiny_demo.train), "--output", str(out),
            "--batch-size", "32", "--num-workers", "0", "--device", "cpu"]
    assert _tool("teacher_embeddings")(args) == 0
    before = _contents(out)
    code, err = _on_a_full_disk(tmp_path, "teacher_embeddings", *args, "--overwrite")
    assert (code, err) == (1, f"teacher_embeddings: {out}: could not write it (No space left on device); the "
                              "earlier folder there is unchanged, and no partial one is left\n")
    assert _contents(out) == before
    assert sorted(os.listdir(tmp_path)) == ["emb"]
