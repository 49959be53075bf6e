"""The edges of mmssl.models.distill that the term tests leave open: the teacher's view of the
student's images (resized and renormalised only when they differ, as torchvision's antialiased
bicubic resize), an online teacher's targets on the student's own tokens, stored targets' dtype,
scale and device, the weights' and feature kind's checks with their exact messages, a term of
weight 1 or 0, the projection only for feature distillation, what a checkpoint records of its
teacher (online or stored), and ``build_distiller``'s refusals and the options it passes on."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from mmssl.checkpoints.layouts import clip_to_open_clip
from mmssl.data.teacher_embeddings import FORMAT, MANIFEST
from mmssl.models.clip import CLIP
from mmssl.models.distill import (
    Distillation,
    Distiller,
    adapt_images,
    build_distiller,
    check_weights,
    feature_distill_loss,
)
from tests.models.test_distill import save_lightning

MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory, tiny_clip_json):
    torch.manual_seed(3)
    return save_lightning(CLIP(tiny_clip_json), tmp_path_factory.mktemp("teacher") / "teacher.ckpt")


def _pixels(h: int, w: int) -> torch.Tensor:
    return torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(h * 100 + w))


def test_images_the_teacher_takes_as_they_are_are_passed_on_untouched():
    images = TF.normalize(_pixels(32, 32), MEAN, STD)
    assert adapt_images(images, MEAN, STD, 32, list(MEAN), list(STD)) is images  # not even a copy


@pytest.mark.parametrize("h, w, teacher_mean, teacher_std", [
    (32, 32, (0.5, 0.5, 0.5), STD),  # another mean only
    (32, 32, MEAN, (0.5, 0.5, 0.5)),  # another std only
    (40, 40, MEAN, STD),  # larger: an antialiased downscale
    (32, 24, MEAN, STD),  # the height right, the width not
    (24, 32, MEAN, STD),  # the width right, the height not
])
def test_images_are_resized_as_torchvision_and_renormalised_for_the_teacher(h, w, teacher_mean, teacher_std):
    pixels = _pixels(h, w)
    images = TF.normalize(pixels, MEAN, STD)
    got = adapt_images(images, MEAN, STD, 32, teacher_mean, teacher_std)
    if (h, w) != (32, 32):  # open_clip's eval resize: bicubic, antialiased
        pixels = TF.resize(pixels, [32, 32], interpolation=InterpolationMode.BICUBIC, antialias=True)
    assert got.shape == (2, 3, 32, 32)
    torch.testing.assert_close(got, TF.normalize(pixels, list(teacher_mean), list(teacher_std)), rtol=0, atol=1e-5)


def test_an_online_teacher_embeds_the_resized_images_and_the_students_tokens(teacher_file):
    distiller = build_distiller(16, Distillation(teacher=str(teacher_file)))
    teacher = distiller.teacher
    assert teacher.image_size == 32 and tuple(teacher.image_mean) != (0.5, 0.5, 0.5)
    pixels = _pixels(40, 40).repeat(2, 1, 1, 1)[:3]  # 3 images
    student_mean = student_std = (0.5, 0.5, 0.5)
    tokens = teacher.tokenizer(["a red circle", "a star", "two crosses"])
    batch = {"image": TF.normalize(pixels, student_mean, student_std), "text": tokens}  # no teacher_tokens
    resized = TF.resize(pixels, [32, 32], interpolation=InterpolationMode.BICUBIC, antialias=True)
    with torch.no_grad():
        want = (teacher.encode_image(TF.normalize(resized, list(teacher.image_mean), list(teacher.image_std))),
                teacher.encode_text(tokens))
    for chunk in (None, 2):  # GradCache's chunks: memory, not values
        image, text, scale = distiller.targets(batch, student_mean, student_std, chunk)
        torch.testing.assert_close(image, want[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(text, want[1], rtol=0, atol=1e-5)
        assert scale.item() == pytest.approx(teacher.logit_scale.item())


def _stored_batch(images: torch.Tensor) -> dict:
    features = torch.tensor([[0.6, 0.8], [1.0, 0.0]], dtype=torch.float64)
    return {"image": images, "teacher_image_features": features, "teacher_text_features": features.flip(1)}


@pytest.mark.parametrize("images, dtype", [
    (torch.zeros(2, 3, 4, 4, dtype=torch.bfloat16), torch.bfloat16),  # the images' floating dtype
    (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.float32),  # float32 for integer pixels
])
def test_stored_targets_take_the_images_dtype(images, dtype):
    distiller = Distiller(2, 2, check_weights(None), "cosine", stored={"embed_dim": 2, "logit_scale": 7.0})
    batch = _stored_batch(images)
    image, text, scale = distiller.targets(batch, MEAN, STD, None)
    assert image.dtype == text.dtype == dtype and scale.item() == 7.0
    torch.testing.assert_close(image, batch["teacher_image_features"].to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(text, batch["teacher_text_features"].to(dtype), rtol=0, atol=0)


def test_stored_targets_without_a_manifest_are_at_scale_one_on_the_images_device():
    distiller = Distiller(2, 2, check_weights(None), "cosine")  # a student rebuilt without its manifest
    _, _, scale = distiller.targets(_stored_batch(torch.zeros(2, 3, 4, 4)), MEAN, STD, None)
    assert scale.item() == 1.0
    meta = {k: v.to("meta") for k, v in _stored_batch(torch.zeros(2, 3, 4, 4)).items()}
    image, _, scale = Distiller(2, 2, check_weights(None), "cosine", stored={"embed_dim": 2, "logit_scale": 7.0}
                                ).targets(meta, MEAN, STD, None)
    assert scale.device.type == "meta" and image.device.type == "meta"  # where a GPU batch is


def test_without_a_teacher_or_stored_rows_the_targets_are_refused_naming_both_options():
    distiller = Distiller(2, 2, check_weights(None), "cosine")
    with pytest.raises(RuntimeError) as info:
        distiller.targets({"image": torch.zeros(1, 3, 4, 4), "text": torch.zeros(1, 4, dtype=torch.long)},
                          MEAN, STD, None)
    assert str(info.value) == ("distillation needs model.init_args.distill.teacher, or distill.embeddings in "
                               "the batch")


def test_weights_are_completed_with_the_defaults_and_checked_with_one_message():
    assert check_weights(None) == {"contrastive": 1.0, "logits": 1.0, "features": 0.0}
    assert check_weights({"features": 2}) == {"contrastive": 1.0, "logits": 1.0, "features": 2.0}
    for bad in ({"feature": 1.0}, {"logits": -0.5}, {"logits": "1"}):
        want = (f"model.init_args.distill.weights: terms ['contrastive', 'logits', 'features'] with weights >= 0, "
                f"got {bad}")
        with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
            check_weights(bad)


def test_the_feature_distance_is_cosine_by_default_and_an_unknown_kind_is_refused_at_construction():
    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(4, 3, generator=g), F.normalize(torch.randn(4, 3, generator=g), dim=1)
    torch.testing.assert_close(feature_distill_loss(student, teacher), feature_distill_loss(student, teacher, "cosine"))
    want = "model.init_args.distill.feature_loss: 'cosine' or 'mse', got 'l1'"
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        feature_distill_loss(student, teacher, "l1")
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        Distiller(3, 3, check_weights(None), "l1")  # before any batch


def test_default_weights_add_the_logit_term_and_no_feature_term_or_projection():
    g = torch.Generator().manual_seed(4)
    image, text = (F.normalize(torch.randn(3, 6, generator=g), dim=1) for _ in range(2))
    t_image, t_text = (F.normalize(torch.randn(3, 8, generator=g), dim=1) for _ in range(2))
    distiller = Distiller(6, 8, check_weights(None), "mse")  # widths differ, but no feature term
    assert distiller.projection is None and not list(distiller.state_dict())
    out = {"image_features": image, "text_features": text, "logit_scale": torch.tensor(5.0)}
    total, terms = distiller(out, torch.tensor(0.75), t_image, t_text, torch.tensor(9.0))
    assert set(terms) == {"contrastive", "logits"}
    assert terms["logits"].item() > 0 and total.item() == pytest.approx(0.75 + terms["logits"].item(), rel=1e-6)


def _manifest(folder, **fields) -> str:
    folder.mkdir(exist_ok=True)
    manifest = {"format": FORMAT, "embed_dim": 3, "logit_scale": 10.0, "teacher": "/runs/t.ckpt", "sha256": "ab12",
                **fields}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return str(folder)


def test_a_student_records_its_stored_embeddings_teacher_and_folder(tmp_path):
    folder = _manifest(tmp_path / "emb")
    distiller = build_distiller(3, Distillation(embeddings=folder))
    assert distiller.provenance() == {"path": "/runs/t.ckpt", "sha256": "ab12", "embed_dim": 3, "embeddings": folder}
    assert Distiller(3, 3, check_weights(None), "cosine").provenance() == {}
    with pytest.raises(ValueError) as info:
        build_distiller(3, Distillation(embeddings=folder, embed_dim=5))
    assert str(info.value) == "model.init_args.distill.embed_dim=5, but the teacher's width is 3"


def test_teacher_and_embeddings_together_are_refused_before_either_is_read(tmp_path):
    with pytest.raises(ValueError) as info:
        build_distiller(16, Distillation(teacher=str(tmp_path / "none.ckpt"), embeddings=str(tmp_path / "none")))
    assert str(info.value) == ("model.init_args.distill.teacher and distill.embeddings: give one (online, or "
                               "stored embeddings)")


def test_a_state_dict_teacher_is_built_from_teacher_model_and_recorded(tmp_path, teacher_file, tiny_clip_json):
    state = tmp_path / "open_clip.pt"
    torch.save(clip_to_open_clip(torch.load(teacher_file, weights_only=True)["state_dict"]), state)
    distiller = build_distiller(16, Distillation(teacher=str(state), teacher_model=tiny_clip_json))
    assert distiller.provenance() == {"path": str(state), "sha256": hashlib.sha256(state.read_bytes()).hexdigest(),
                                      "embed_dim": 32}
    # The tokenizer folder is passed on: open_clip's BPE teacher refuses one.
    with pytest.raises(ValueError, match="uses open_clip's built-in BPE tokenizer; leave it unset"):
        build_distiller(16, Distillation(teacher=str(teacher_file), teacher_tokenizer=str(tmp_path)))
