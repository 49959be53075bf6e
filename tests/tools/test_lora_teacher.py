"""tools/teacher_embeddings.py on a LoRA checkpoint: refused with the way out (export it merged,
then pass the folder), which the test follows to the end; the loader's hint (name the right model)
was wrong for it."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from mmssl.models.clip import CLIP  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str, *argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = runpy.run_path(str(REPO / "tools" / f"{name}.py"), run_name="test")["main"](list(argv))
    return code, err.getvalue()


def test_a_lora_teacher_is_refused_with_the_export_that_makes_it_one(tmp_path, tiny_clip_json, tiny_demo):
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), tmp_path / "base.pth")
    module = CLIP(model_name=tiny_clip_json, pretrained=str(tmp_path / "base.pth"), lora={"r": 2})
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    ckpt = tmp_path / "lora.ckpt"
    torch.save(checkpoint, ckpt)
    data = ["--data", os.path.dirname(tiny_demo.train), "--num-workers", "0", "--batch-size", "32"]
    code, err = _tool("teacher_embeddings", "--ckpt", str(ckpt), *data, "--output", str(tmp_path / "emb"))
    assert (code, err) == (1, f"teacher_embeddings: --ckpt '{ckpt}' is a LoRA checkpoint (adapters over a base "
                              "model), which a teacher does not read: merge it into a folder with tools/export.py "
                              f"--ckpt {ckpt} --format open_clip_hf --output DIR, and pass --ckpt DIR\n")
    assert _tool("export", "--ckpt", str(ckpt), "--format", "open_clip_hf", "--output", str(tmp_path / "merged")) \
        == (0, "")
    assert _tool("teacher_embeddings", "--ckpt", str(tmp_path / "merged"), *data, "--output",
                 str(tmp_path / "emb"))[0] == 0


def test_a_lora_checkpoint_as_an_online_teacher_is_refused_with_the_way_out(tmp_path, tiny_clip_json):
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), tmp_path / "base.pth")
    module = CLIP(model_name=tiny_clip_json, pretrained=str(tmp_path / "base.pth"), lora={"r": 2})
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "lora.ckpt")
    with pytest.raises(ValueError, match=rf"distill.teacher: {tmp_path / 'lora.ckpt'} is a LoRA checkpoint .*"
                                         r"--format open_clip_hf --output DIR, and pass DIR"):
        CLIP(model_name=tiny_clip_json, distill={"teacher": str(tmp_path / "lora.ckpt")})
