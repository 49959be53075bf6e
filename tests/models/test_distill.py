"""Distillation from a teacher (mmssl.models.distill, mmssl.models.teacher): the loss terms against
open_clip's DistillClipLoss, every teacher file form, the teacher frozen and out of the student's
checkpoint, bad teacher files refused at start-up naming them, and stored embeddings giving the
online loss (tools/teacher_embeddings.py), with missing or wrong-width rows counted as bad samples."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from mmssl.checkpoints import UnsafeCheckpointError
from mmssl.checkpoints.layouts import clip_to_open_clip
from mmssl.checkpoints.load import build_module, checkpoint_kind
from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.teacher_embeddings import write_side_file
from mmssl.losses import clip_loss
from mmssl.models.clip import CLIP
from mmssl.models.distill import feature_distill_loss, logit_distill_loss
from mmssl.models.teacher import load_teacher

REPO = Path(__file__).resolve().parents[2]
CAPTIONS = ["a red circle", "a blue square on a green field", "a star", "two crosses"]
# Narrower and with a shorter context than conftest's TINY_CLIP teacher: a projection, and a second tokenisation.
STUDENT = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


def save_lightning(module: CLIP, path: Path) -> Path:
    """``module`` as ``mmssl fit`` saves it (its state dict and LightningCLI's hyper-parameters)."""
    hparams = {**dict(module.hparams), "_class_path": "mmssl.models.clip.CLIP"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory, tiny_clip_json) -> Path:
    torch.manual_seed(3)
    return save_lightning(CLIP(tiny_clip_json), tmp_path_factory.mktemp("teacher") / "teacher.ckpt")


@pytest.fixture(scope="module")
def student_json(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("student") / "student.json"
    path.write_text(json.dumps(STUDENT))
    return str(path)


def test_terms_are_open_clip_distill_clip_loss_and_the_feature_distances():
    g = torch.Generator().manual_seed(0)
    image, text, t_image, t_text = (F.normalize(torch.randn(6, d, generator=g), dim=-1) for d in (8, 8, 12, 12))
    scale, t_scale = torch.tensor(7.0), torch.tensor(20.0)
    contrastive, distill = DistillClipLoss()(image, text, scale, t_image, t_text, t_scale)
    assert clip_loss(image, text, scale) == pytest.approx(contrastive.item(), rel=1e-6)
    ours = logit_distill_loss(image, text, scale, image, text, t_image, t_text, t_scale, t_image, t_text)
    assert ours.item() == pytest.approx(distill.item(), rel=1e-6)
    student = torch.randn(6, 12, generator=g)
    cosine = 1 - (student * t_image).sum(-1) / student.norm(dim=-1)  # t_image is unit length
    assert feature_distill_loss(student, t_image, "cosine").item() == pytest.approx(cosine.mean().item(), rel=1e-5)
    mse = ((student - t_image) ** 2).sum(-1).mean()
    assert feature_distill_loss(student, t_image, "mse").item() == pytest.approx(mse.item(), rel=1e-6)


def _check_forms(module: CLIP, forms: dict) -> None:
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = (module.encode_image(images), module.encode_text(module.tokenizer(CAPTIONS)))
    for form, (path, model) in forms.items():
        teacher = load_teacher(str(path), model)
        with torch.no_grad():
            got = teacher.encode_image(images), teacher.encode_text(teacher.tokenizer(CAPTIONS))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-5, msg=form)
        assert teacher.embed_dim == 32 and teacher.image_size == 32, form
        assert teacher.logit_scale.item() == pytest.approx(module.model.logit_scale.exp().item(), rel=1e-6), form


def _module(teacher_file: Path) -> CLIP:
    checkpoint = torch.load(teacher_file)
    return build_module(str(teacher_file), checkpoint, checkpoint_kind(str(teacher_file), checkpoint))


def test_open_clip_teacher_forms_embed_as_the_module(tmp_path, teacher_file, tiny_clip_json):
    from mmssl.export.hub import write_open_clip_hf

    module = _module(teacher_file)
    torch.save(clip_to_open_clip(module.state_dict()), tmp_path / "open_clip.pt")
    write_open_clip_hf(module, str(tmp_path / "oc_hf"))
    _check_forms(module, {"ckpt": (teacher_file, None), "state_dict": (tmp_path / "open_clip.pt", tiny_clip_json),
                          "open_clip_hf": (tmp_path / "oc_hf", None)})


def test_a_transformers_folder_teacher_embeds_as_the_module(tmp_path, teacher_file):
    from mmssl.export.hf import write_hf

    module = _module(teacher_file)
    write_hf(module, str(tmp_path / "hf"))
    _check_forms(module, {"hf": (tmp_path / "hf", None)})


def test_the_teacher_stays_frozen_and_out_of_the_students_checkpoint(tmp_path, teacher_file, student_json):
    student = CLIP(student_json, distill={"teacher": str(teacher_file), "weights": {"features": 1.0}})
    student.train()
    teacher = student.distiller.teacher
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert student.teacher_text_tokenizer is teacher.tokenizer  # context 16 vs 12: tokenised twice
    batch = {"image": torch.randn(4, 3, 32, 32), "text": student.tokenizer(CAPTIONS),
             "teacher_tokens": teacher.tokenizer(CAPTIONS)}
    student.training_step(batch, 0).backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    state = student.state_dict()
    assert not any(k.startswith(("distiller.teacher", "distiller._teacher")) for k in state)
    assert {k for k in state if k.startswith("distiller.")} == {"distiller.projection.weight"}
    assert copy.deepcopy(student).distiller.teacher is teacher  # an EMA copy shares, not copies, it
    checkpoint = {"state_dict": state, "hyper_parameters": {**dict(student.hparams), "_class_path": "CLIP"}}
    student.on_save_checkpoint(checkpoint)
    assert checkpoint["teacher"]["sha256"] == hashlib.sha256(teacher_file.read_bytes()).hexdigest()
    assert (
        checkpoint["teacher"]["path"] == str(teacher_file)
        and checkpoint["hyper_parameters"]["distill"]["embed_dim"] == 32
    )
    # An evaluation or export rebuilds the student without its teacher, projection included.
    rebuilt = build_module("student.ckpt", checkpoint, checkpoint_kind("student.ckpt", checkpoint))
    assert rebuilt.distiller.teacher is None
    torch.testing.assert_close(rebuilt.distiller.projection.weight, student.distiller.projection.weight)


class _Payload:
    def __reduce__(self):
        return os.system, ("true",)


def test_bad_teacher_files_are_refused_at_start_up_naming_them(tmp_path, teacher_file, student_json):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(teacher_file.read_bytes()[: teacher_file.stat().st_size // 2])
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": _Payload()}}, evil)
    bare = tmp_path / "bare.pt"
    torch.save(clip_to_open_clip(torch.load(teacher_file)["state_dict"]), bare)
    for path, error in ((tmp_path / "missing.ckpt", FileNotFoundError), (truncated, ValueError),
                        (evil, UnsafeCheckpointError), (bare, ValueError)):
        with pytest.raises(error, match="model.init_args.distill.teacher") as info:
            CLIP(student_json, distill={"teacher": str(path)})
        assert str(path) in str(info.value)
    # A teacher whose config tokenises with a Hugging Face tokenizer that is not on disk.
    config = json.loads(Path(student_json).read_text())
    config["text_cfg"]["hf_tokenizer_name"] = "timm/ViT-B-16-SigLIP"
    (tmp_path / "hf_tok.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download timm/ViT-B-16-SigLIP"):
        teacher = save_lightning(CLIP(str(tmp_path / "hf_tok.json")), tmp_path / "t.ckpt")
        CLIP(student_json, distill={"teacher": str(teacher)})


def _tool(*argv: str) -> int:
    return runpy.run_path(str(REPO / "tools" / "teacher_embeddings.py"), run_name="test")["main"](list(argv))


def _first_batch(model: CLIP, data: str, **kwargs) -> dict:
    dm = ImageTextDataModule(
        train_data=data,
        batch_size=8,
        num_workers=0,
        image_size=model.image_size,
        tokenizer=model.tokenizer,
        crop_scale=(1.0, 1.0),
        teacher_tokenizer=model.teacher_text_tokenizer,
        teacher_embeddings=model.teacher_embeddings,
        max_bad_fraction=1.0,
        **kwargs,
    )
    batches = list(dm.build_stream(data, True))
    return {k: v for k, v in batches[0].items() if not k.startswith("__")}, sum(b["__skipped__"] for b in batches)


def test_stored_embeddings_give_the_online_loss_and_bad_rows_are_counted(
    tmp_path, tiny_demo, teacher_file, student_json, caplog
):
    train, out = os.path.dirname(tiny_demo.train), tmp_path / "emb"
    assert _tool("--ckpt", str(teacher_file), "--data", train, "--output", str(out), "--batch-size", "8",
                 "--num-workers", "0", "--output-json", str(tmp_path / "emb.json")) == 0
    assert json.loads((tmp_path / "emb.json").read_text())["samples"] == 64
    weights = {"features": 0.5}
    students = {}
    for how in ("online", "stored"):
        torch.manual_seed(5)
        kwargs = {"teacher": str(teacher_file)} if how == "online" else {"embeddings": str(out)}
        students[how] = CLIP(student_json, distill={"weights": weights, **kwargs})
    losses, grads = {}, {}
    for how, student in students.items():
        batch, skipped = _first_batch(student, train)
        assert skipped == 0 and ("teacher_image_features" in batch) == (how == "stored")
        losses[how] = student.training_step(batch, 0)
        losses[how].backward()
        grads[how] = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    assert losses["stored"].item() == pytest.approx(losses["online"].item(), rel=1e-5)
    for name, grad in grads["online"].items():
        torch.testing.assert_close(grads["stored"][name], grad, rtol=1e-4, atol=1e-4, msg=name)  # grads up to ~40
    # One key missing from shard 0, shard 1 of another width, no side file for shard 2: 1 + 16 + 16 bad.
    with np.load(out / "0.npz") as f:
        write_side_file(str(out / "0.npz"), list(f["keys"][1:]), f["image"][1:], f["text"][1:])
    with np.load(out / "1.npz") as f:
        write_side_file(str(out / "1.npz"), list(f["keys"]), np.zeros((16, 5)), np.zeros((16, 5)))
    os.remove(out / "2.npz")
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        _, skipped = _first_batch(students["stored"], train)
    named = {m.split(": ", 1)[0] for m in caplog.messages if m.startswith("skipped sample")}
    reasons = " ".join(caplog.messages)
    # Every bad sample named; counted again in each further pass that fills the epoch's batches.
    assert len(named) == 33 and skipped >= 33
    for reason in ("no teacher embeddings for key", "no teacher embeddings file", "the manifest says 32"):
        assert reason in reasons
