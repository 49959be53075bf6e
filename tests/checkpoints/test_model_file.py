"""One way from a file to a model (mmssl.checkpoints.model_file): every loader reads the class a
checkpoint records and its run's config.yaml, moves renamed hyper-parameters, follows **kwargs
to the parent's arguments and rebuilds without the files a trained module no longer needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

from mmssl.checkpoints.load import build_module, load_lightning
from mmssl.checkpoints.model_file import init_args, init_parameters, lightning_open_clip_state, read_model_file
from mmssl.models import ImageClassifier
from mmssl.models.clip import CLIP
from mmssl.models.coca import CoCa
from mmssl.models.distill import DISTILL_RENAMES
from mmssl.models.m3ae import M3AE
from mmssl.models.teacher import load_teacher
from mmssl.models.zero_shot_head import clip_zero_shot_head

TINY_M3AE = dict(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32,
                 decoder_depth=1, decoder_num_heads=2, text_length=8)
TINY_VIT = dict(num_classes=3, model_name="vit_tiny_patch16_224", image_size=32, mixup=0.0, cutmix=0.0,
                model_kwargs=dict(patch_size=8, embed_dim=32, depth=1, num_heads=2))


def _save(module: torch.nn.Module, path: Path, hparams: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hparams = dict(module.hparams) if hparams is None else hparams
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


def test_the_run_config_names_the_class_for_the_teacher_pretrained_and_zero_shot_head(tmp_path, tiny_clip_json):
    # A CLIP's weights with no recorded class, in a run whose config.yaml says MAE: every loader
    # believes the run's record (the weights alone would say CLIP) and refuses, naming the file.
    ckpt = _save(CLIP(tiny_clip_json), tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "run" / "config.yaml").write_text("model:\n  class_path: mmssl.models.mae.MAE\n")
    with pytest.raises(ValueError, match=f"model.init_args.distill.teacher: {ckpt} is a MAE checkpoint"):
        load_teacher(str(ckpt))
    with pytest.raises(ValueError, match=f"model.zero_shot_head: {ckpt} is a MAE checkpoint"):
        clip_zero_shot_head(str(ckpt), "a,b")
    with pytest.raises(ValueError, match=f"{ckpt}: a MAE file holds no open_clip model"):
        lightning_open_clip_state(str(ckpt))
    (tmp_path / "run" / "config.yaml").write_text("model:\n  class_path: mmssl.models.clip.CLIP\n")
    assert read_model_file(str(ckpt)).kind.name == "CLIP"
    assert load_teacher(str(ckpt)).embed_dim == 32


def test_a_checkpoint_with_flat_distillation_keys_rebuilds_and_teaches(tmp_path, tiny_clip_json):
    # A distilled student as written before distillation became a config group: flat keys, its
    # teacher's file gone. Rebuilt, the teacher is not read and the projection is the checkpoint's.
    torch.manual_seed(0)
    student = CLIP(tiny_clip_json, distill={"embed_dim": 24, "weights": {"features": 1.0}})
    hparams = {k: v for k, v in dict(student.hparams).items() if k != "distill"}
    group = {**dict(student.hparams)["distill"], "teacher": str(tmp_path / "gone.ckpt")}
    hparams.update({old: group[new.partition(".")[2]] for old, new in DISTILL_RENAMES.items()},
                   _class_path="mmssl.models.clip.CLIP")
    ckpt = _save(student, tmp_path / "old.ckpt", hparams)
    with pytest.warns(FutureWarning, match=f"{ckpt}: renamed config keys.*teacher -> distill.teacher"):
        rebuilt = load_lightning(str(ckpt))
    assert rebuilt.distiller.teacher is None
    torch.testing.assert_close(rebuilt.distiller.projection.weight, student.distiller.projection.weight)
    with pytest.warns(FutureWarning, match=str(ckpt)):
        teacher = load_teacher(str(ckpt))  # its model_name read through the same upgrade
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(teacher.encode_image(images), student.model.encode_image(images, normalize=True))
    # The same checkpoint written with the group: its files nulled, its embed_dim kept.
    grouped = dict(student.hparams, distill={**dict(student.hparams)["distill"], "teacher": str(tmp_path / "gone")})
    checkpoint = {"state_dict": student.state_dict(), "hyper_parameters": grouped}
    assert build_module("new.ckpt", checkpoint, read_model_file(str(ckpt)).kind).distiller.teacher is None


def test_init_arguments_follow_kwargs_to_the_parent_class(tmp_path, tiny_coca_json):
    assert {"pretrained", "image_tower_init", "flip", "lock", "caption_loss_weight"} <= init_parameters(CoCa)
    with pytest.raises(ValueError, match=r"x.ckpt: hyper-parameters \['bogus'\] are not arguments of CoCa"):
        init_args(CoCa, {"model_name": tiny_coca_json, "bogus": 1}, "x.ckpt")
    # A CoCa started from a pretrained file (a CLIP argument it takes through **kwargs) rebuilds
    # from its checkpoint without that file.
    torch.manual_seed(0)
    coca = CoCa(tiny_coca_json)
    ckpt = _save(coca, tmp_path / "coca.ckpt", {**dict(coca.hparams), "pretrained": str(tmp_path / "gone.pt")})
    rebuilt = load_lightning(str(ckpt))
    assert type(rebuilt) is CoCa
    torch.testing.assert_close(rebuilt.model.logit_scale, coca.model.logit_scale)


def test_an_m3ae_checkpoint_loads_and_its_image_encoder_is_a_timm_vit(tmp_path):
    torch.manual_seed(0)
    m3ae = M3AE(**TINY_M3AE).eval()
    with torch.no_grad():
        m3ae.image_type.normal_()  # a modality embedding far from 0: folded wrongly, the features differ
    ckpt = _save(m3ae, tmp_path / "m3ae.ckpt")  # no recorded class: the weights say M3AE, not MAE
    loaded = load_lightning(str(ckpt))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = m3ae.encode_image(images)  # the image alone, modality embedding on its patches
        torch.testing.assert_close(loaded.encode_image(images), want, rtol=0, atol=0)
        # The timm export of its encoder (image_type folded into the patch positions) computes the same.
        kind = read_model_file(str(ckpt)).kind
        vit = timm.create_model(**{k: v for k, v in kind.timm(m3ae.hparams).items() if k != "architecture"},
                                model_name=kind.timm(m3ae.hparams)["architecture"], pretrained=False)
        vit.load_state_dict(kind.vit(m3ae.state_dict()), strict=True)
        torch.testing.assert_close(vit.eval()(images), want, rtol=1e-5, atol=1e-5)
        # And it starts a timm fine-tune as an MAE encoder does.
        classifier = ImageClassifier(**TINY_VIT, global_pool="token", init_encoder=str(ckpt)).eval()
        torch.testing.assert_close(classifier.model.forward_features(images)[:, 0], want, rtol=1e-5, atol=1e-5)


def test_init_encoder_believes_the_runs_config_yaml(tmp_path):
    # An M3AE's weights with no recorded class, in a run whose config.yaml says ImageClassifier: the
    # encoder is read as the record says (and refused, naming the file), not guessed from the keys.
    ckpt = _save(M3AE(**TINY_M3AE), tmp_path / "run" / "checkpoints" / "last.ckpt")
    ImageClassifier(**TINY_VIT, global_pool="token", init_encoder=str(ckpt))  # the keys alone: an M3AE
    (tmp_path / "run" / "config.yaml").write_text("model:\n  class_path: mmssl.models.classifier.ImageClassifier\n")
    with pytest.raises(KeyError, match=f"{ckpt}"):
        ImageClassifier(**TINY_VIT, global_pool="token", init_encoder=str(ckpt))
