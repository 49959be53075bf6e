"""Each distillation term of mmssl.models.distill.Distiller against a hand computation (the
student's image embedding against the teacher's image embedding, text against text, each model's
logits at its own scale), the weighted total, the stored embeddings' targets, and stored teacher
embeddings joined to samples by key whatever the side file's row order
(mmssl.data.teacher_embeddings)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmssl.data.teacher_embeddings import FORMAT, MANIFEST, TeacherEmbeddings, side_file, write_side_file
from mmssl.models.distill import Distiller


def _soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_j softmax(teacher)_j log softmax(student)_j (Hinton et al. 2015, T = 1)."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean()


def _feature_distance(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "cosine":
        return (1 - (student * teacher).sum(dim=1) / (student.norm(dim=1) * teacher.norm(dim=1))).mean()
    return ((student - teacher) ** 2).sum(dim=1).mean()


@pytest.mark.parametrize("kind", ["cosine", "mse"])
@pytest.mark.parametrize("teacher_dim", [8, 6])  # a projection into the teacher's width; none at the same width
def test_each_term_and_the_total_are_the_hand_computed_ones(kind, teacher_dim):
    g = torch.Generator().manual_seed(0)
    batch, dim = 5, 6
    image, text = (F.normalize(torch.randn(batch, dim, generator=g), dim=1) for _ in range(2))
    scale, t_scale, contrastive = torch.tensor(5.0), torch.tensor(12.0), torch.tensor(1.25)
    weights = {"contrastive": 0.5, "logits": 2.0, "features": 3.0}
    distiller = Distiller(dim, teacher_dim, weights, kind).requires_grad_(False)
    assert (distiller.projection is None) == (teacher_dim == dim)
    project = distiller.projection.weight.T if teacher_dim != dim else torch.eye(dim)  # (D, Dt)
    # The teacher's embeddings near the student's own (as after some training), image and text apart.
    t_image, t_text = (F.normalize(x @ project + 0.3 * torch.randn(batch, teacher_dim, generator=g), dim=1)
                       for x in (image, text))
    with torch.no_grad():
        total, terms = distiller({"image_features": image, "text_features": text, "logit_scale": scale},
                                 contrastive, t_image, t_text, t_scale)
    logits = (_soft_cross_entropy(t_scale * t_image @ t_text.T, scale * image @ text.T)
              + _soft_cross_entropy(t_scale * t_text @ t_image.T, scale * text @ image.T)) / 2
    features = (_feature_distance(image @ project, t_image, kind) + _feature_distance(text @ project, t_text, kind)) / 2
    crossed = (_feature_distance(image @ project, t_text, kind) + _feature_distance(text @ project, t_image, kind)) / 2
    assert float(crossed) > 1.5 * float(features)  # image against text would be seen
    assert set(terms) == {"contrastive", "logits", "features"}
    assert terms["contrastive"].item() == 1.25
    assert terms["logits"].item() == pytest.approx(logits.item(), rel=1e-5)
    assert terms["features"].item() == pytest.approx(features.item(), rel=1e-5)
    assert total.item() == pytest.approx(0.5 * 1.25 + 2.0 * logits.item() + 3.0 * features.item(), rel=1e-5)


def test_a_term_of_weight_zero_is_left_out():
    g = torch.Generator().manual_seed(1)
    image, text, t_image, t_text = (F.normalize(torch.randn(3, 4, generator=g), dim=1) for _ in range(4))
    distiller = Distiller(4, 4, {"contrastive": 1.0, "logits": 0.0, "features": 1.0}, "mse")
    total, terms = distiller({"image_features": image, "text_features": text, "logit_scale": torch.tensor(3.0)},
                             torch.tensor(0.5), t_image, t_text, torch.tensor(9.0))
    want = (_feature_distance(image, t_image, "mse") + _feature_distance(text, t_text, "mse")) / 2
    assert set(terms) == {"contrastive", "features"} and total.item() == pytest.approx(0.5 + want.item(), rel=1e-5)


def test_stored_targets_are_the_batchs_image_and_text_rows_at_the_manifests_scale():
    batch = {"image": torch.zeros(2, 3, 4, 4), "teacher_image_features": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
             "teacher_text_features": torch.tensor([[0.6, 0.8], [0.8, 0.6]])}
    distiller = Distiller(2, 2, {"contrastive": 1.0, "logits": 1.0, "features": 0.0}, "cosine",
                          stored={"embed_dim": 2, "logit_scale": 42.5})
    image, text, scale = distiller.targets(batch, (0.5,) * 3, (0.5,) * 3, None)
    assert torch.equal(image, batch["teacher_image_features"]) and torch.equal(text, batch["teacher_text_features"])
    assert scale.item() == 42.5


def test_stored_embeddings_join_each_sample_to_its_own_row_in_any_row_order(tmp_path):
    """The side file's rows in shuffled key order (as a teacher tool's workers may write them): each
    sample gets the row of its own key, not the row of its place in sorted or shard order."""
    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "embed_dim": 3, "logit_scale": 10.0}))
    keys = [f"{i:06d}" for i in range(10)]
    order = np.random.default_rng(0).permutation(10)
    assert list(order) != sorted(order)
    rows = {k: (np.full(3, i, dtype=np.float32), np.full(3, -i, dtype=np.float32)) for i, k in enumerate(keys)}
    url = "/data/shards/00003.tar"
    write_side_file(side_file(str(tmp_path), url), [keys[i] for i in order],
                    np.stack([rows[keys[i]][0] for i in order]), np.stack([rows[keys[i]][1] for i in order]))
    join = TeacherEmbeddings(str(tmp_path))
    for key in np.random.default_rng(1).permutation(keys):  # samples in yet another order
        image, text = join.lookup({"__url__": url, "__key__": str(key)})
        np.testing.assert_array_equal(image, rows[key][0])
        np.testing.assert_array_equal(text, rows[key][1])


@pytest.mark.parametrize("field, value, says", [
    ("embed_dim", -3, "embed_dim must be a positive integer, got -3"),
    ("embed_dim", True, "embed_dim must be a positive integer, got True"),
    ("logit_scale", float("nan"), "logit_scale must be a finite number, got nan"),
    ("logit_scale", "10", "logit_scale must be a finite number, got '10'"),
])
def test_a_manifest_with_a_bad_width_or_scale_is_refused_naming_it(tmp_path, field, value, says):
    """#44 item 13: these passed the manifest check and failed later, far from the file."""
    manifest = {"format": FORMAT, "embed_dim": 3, "logit_scale": 10.0, field: value}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"{tmp_path / MANIFEST}: {says}"):
        TeacherEmbeddings(str(tmp_path))


def test_a_non_finite_stored_row_is_a_bad_sample_not_a_nan_target(tmp_path):
    from mmssl.data.decode import BadSample

    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "embed_dim": 2, "logit_scale": 10.0}))
    url = "/data/shards/00000.tar"
    image = np.array([[1.0, 0.0], [np.nan, 0.0]], dtype=np.float32)
    write_side_file(side_file(str(tmp_path), url), ["a", "b"], image, np.ones((2, 2), dtype=np.float32))
    join = TeacherEmbeddings(str(tmp_path))
    assert join.lookup({"__url__": url, "__key__": "a"})[0].tolist() == [1.0, 0.0]
    with pytest.raises(BadSample, match="non-finite teacher embeddings for key 'b'"):
        join.lookup({"__url__": url, "__key__": "b"})
