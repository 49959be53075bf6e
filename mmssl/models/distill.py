"""Distillation of a CLIP student from a frozen teacher: the loss terms and the student's side.

Terms, each with its weight (``model.init_args.distill_weights``):

* ``contrastive``: the student's own CLIP / SigLIP loss;
* ``logits``: open_clip's ``DistillClipLoss`` term (as ``open_clip_train --distill-model``; CLIP-KD's
  "ICL"-free logit KD, TinyCLIP's affinity mimicking): the cross-entropy of the student's
  image->text and text->image logits against the teacher's softmax, each model at its own logit
  scale. For a SigLIP student its logits drop the bias, which a row softmax ignores anyway;
* ``features``: feature distillation (CLIP-KD sec. 3.2 "FD"): the student's L2-normalised
  embeddings, through a learned linear projection when the widths differ, against the teacher's:
  ``cosine`` (1 - cos, per sample) or ``mse`` (squared distance summed over the width).

Under DDP every term is rank-local and exact: each rank scores its own B rows against the N
columns of every rank (the student's gathered with gradients, the teacher's without), and each
term is a mean over this rank's rows, so the mean over ranks, which DDP's gradient averaging takes,
is the loss of one process on the concatenated batch (tested on 2 gloo processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss
from torch import Tensor, nn

from mmssl.data.teacher_embeddings import read_manifest
from mmssl.distributed import gather_with_grad
from mmssl.models.gradcache import cached_features
from mmssl.models.teacher import Teacher, load_teacher

TERMS = ("contrastive", "logits", "features")
DEFAULT_WEIGHTS = {"contrastive": 1.0, "logits": 1.0, "features": 0.0}
# open_clip's KD term, used for its ``dist_loss`` only: its forward gathers inside (with the
# deprecated torch.distributed.nn all-gather) from a rank and world size stored at construction;
# mmssl gathers once, in mmssl.distributed.
_OPEN_CLIP_KD = DistillClipLoss()


def check_weights(weights: Optional[dict[str, float]]) -> dict[str, float]:
    """``distill.weights`` completed with the defaults, checked (names known, values >= 0)."""
    merged = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = sorted(set(merged) - set(TERMS))
    if unknown or any(not isinstance(v, (int, float)) or v < 0 for v in merged.values()):
        raise ValueError(f"model.init_args.distill.weights: terms {list(TERMS)} with weights >= 0, got {weights}")
    return {k: float(v) for k, v in merged.items()}


def logit_distill_loss(image: Tensor, text: Tensor, logit_scale: Tensor, all_image: Tensor, all_text: Tensor,
                       teacher_image: Tensor, teacher_text: Tensor, teacher_scale: Tensor,
                       all_teacher_image: Tensor, all_teacher_text: Tensor) -> Tensor:
    """open_clip's ``DistillClipLoss`` distillation term on this rank's rows.

    Args:
        image, text: (B, D) the student's normalised embeddings of this rank.
        logit_scale: the student's exponentiated scale.
        all_image, all_text: (N, D) the student's embeddings of every rank.
        teacher_image, teacher_text: (B, Dt) the teacher's embeddings of this rank.
        teacher_scale: the teacher's exponentiated scale.
        all_teacher_image, all_teacher_text: (N, Dt) the teacher's of every rank.

    Returns:
        Scalar: the mean of the image->text and text->image soft cross-entropies over B rows.
    """
    student_i2t, student_t2i = logit_scale * image @ all_text.T, logit_scale * text @ all_image.T  # (B, N)
    teacher_i2t = teacher_scale * teacher_image @ all_teacher_text.T  # (B, N)
    teacher_t2i = teacher_scale * teacher_text @ all_teacher_image.T
    kd = _OPEN_CLIP_KD.dist_loss
    return (kd(teacher_i2t.float(), student_i2t.float()) + kd(teacher_t2i.float(), student_t2i.float())) / 2


def feature_distill_loss(student: Tensor, teacher: Tensor, kind: str = "cosine") -> Tensor:
    """Feature distillation between (B, D) projected student and (B, D) teacher embeddings.

    Returns:
        Scalar: mean over the B rows of ``1 - cos`` (``cosine``) or of the squared distance (``mse``).
    """
    student, teacher = student.float(), teacher.float()
    if kind == "cosine":
        return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()
    if kind == "mse":
        return (student - teacher).pow(2).sum(dim=-1).mean()
    raise ValueError(f"model.init_args.distill.feature_loss: 'cosine' or 'mse', got {kind!r}")


def adapt_images(images: Tensor, mean: tuple, std: tuple, size: int, teacher_mean: tuple, teacher_std: tuple) -> Tensor:
    """The student's normalised (B, 3, H, W) images as the teacher takes them: one bicubic resize
    (antialiased, as open_clip's eval resize) to (B, 3, size, size) and the teacher's
    normalisation, on the images' device; unchanged when size and normalisation agree."""
    if images.shape[-1] == size and images.shape[-2] == size and tuple(mean) == tuple(teacher_mean) \
            and tuple(std) == tuple(teacher_std):
        return images
    shape = (1, 3, 1, 1)
    x = images * images.new_tensor(std).view(shape) + images.new_tensor(mean).view(shape)  # [0, 1] pixels
    if images.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return (x - x.new_tensor(teacher_mean).view(shape)) / x.new_tensor(teacher_std).view(shape)


class _Unowned:
    """Holds the teacher outside the student's modules: not in its ``state_dict``, parameters,
    ``.to()`` or DDP; a ``deepcopy`` of the student (an EMA copy) shares it rather than copying it."""

    def __init__(self, teacher: Optional[Teacher]) -> None:
        self.teacher = teacher

    def __deepcopy__(self, memo: dict) -> "_Unowned":
        return self


class Distiller(nn.Module):
    """The student's distillation state: the projection (a submodule: saved, trained), the
    teacher (online) or the stored embeddings' scale, and the terms.

    Args:
        student_dim: the student's embedding width.
        teacher_dim: the teacher's.
        weights: see :func:`check_weights`.
        feature_loss: ``cosine`` or ``mse``.
        teacher: the online teacher (``None``: stored embeddings, or a student rebuilt for evaluation).
        stored: the manifest of stored embeddings (:func:`mmssl.data.teacher_embeddings.read_manifest`).
    """

    def __init__(self, student_dim: int, teacher_dim: int, weights: dict[str, float], feature_loss: str,
                 teacher: Optional[Teacher] = None, stored: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        feature_distill_loss(torch.zeros(1, 1), torch.zeros(1, 1), feature_loss)  # the kind is checked now
        self.weights, self.feature_loss = weights, feature_loss
        self._teacher, self.stored, self.teacher_dim = _Unowned(teacher), stored, teacher_dim
        # CLIP-KD / TinyCLIP: a linear map of the student's embedding into the teacher's space.
        self.projection: Optional[nn.Linear] = None
        if weights["features"] > 0 and student_dim != teacher_dim:
            self.projection = nn.Linear(student_dim, teacher_dim, bias=False)

    def forward(self, out: dict[str, Tensor], contrastive: Tensor, teacher_image: Tensor, teacher_text: Tensor,
                teacher_scale: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted loss of this rank and its terms (for logging).

        Args:
            out: the student's ``forward`` output (``image_features``, ``text_features``, ``logit_scale``).
            contrastive: the student's contrastive loss of this rank.
            teacher_image, teacher_text: (B, Dt) the teacher's normalised embeddings of this rank.
            teacher_scale: the teacher's exponentiated logit scale.
        """
        image, text, scale = out["image_features"], out["text_features"], out["logit_scale"]
        terms = {"contrastive": contrastive}
        w = self.weights
        if w["logits"] > 0:
            # Gathered as the contrastive loss gathers: this rank's rows against every rank's columns.
            all_image, all_text = gather_with_grad(image, same_size=True), gather_with_grad(text, same_size=True)
            with torch.no_grad():
                all_t_image = gather_with_grad(teacher_image, same_size=True)
                all_t_text = gather_with_grad(teacher_text, same_size=True)
            terms["logits"] = logit_distill_loss(image, text, scale, all_image, all_text, teacher_image,
                                                 teacher_text, teacher_scale.to(scale.dtype), all_t_image, all_t_text)
        if w["features"] > 0:
            project = self.projection if self.projection is not None else (lambda x: x)
            terms["features"] = (feature_distill_loss(project(image), teacher_image, self.feature_loss)
                                 + feature_distill_loss(project(text), teacher_text, self.feature_loss)) / 2
        total = sum(w[k] * v for k, v in terms.items())
        return total, terms

    @property
    def teacher(self) -> Optional[Teacher]:
        return self._teacher.teacher

    def provenance(self) -> dict[str, Any]:
        """What a student's checkpoint records of its teacher: file and SHA-256 (never its weights)."""
        if self.teacher is not None:
            return {"path": self.teacher.source, "sha256": self.teacher.sha256, "embed_dim": self.teacher.embed_dim}
        if self.stored is not None:
            return {"path": self.stored.get("teacher"), "sha256": self.stored.get("sha256"),
                    "embed_dim": self.stored["embed_dim"], "embeddings": self.stored.get("folder")}
        return {}

    def targets(self, batch: dict[str, Tensor], mean: tuple, std: tuple,
                chunk_size: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The teacher's (B, Dt) image and text embeddings of a training batch and its scale.

        Stored embeddings when the batch carries them; else the online teacher, in eval mode under
        ``torch.no_grad`` (and the run's autocast), on the student's images resized and
        renormalised for it, on its own tokens (``teacher_tokens``) or the student's, in chunks of
        ``chunk_size`` when the student uses GradCache (memory, not values).
        """
        images = batch["image"]
        if "teacher_image_features" in batch:
            scale = torch.tensor(float(self.stored["logit_scale"]) if self.stored else 1.0, device=images.device)
            cast = images.dtype if images.is_floating_point() else torch.float32
            return batch["teacher_image_features"].to(cast), batch["teacher_text_features"].to(cast), scale
        teacher = self.teacher
        if teacher is None:
            raise RuntimeError("distillation needs model.init_args.distill.teacher, or distill.embeddings in the batch")
        with torch.no_grad():
            teacher.follow(images)
            adapted = adapt_images(images, mean, std, teacher.image_size, teacher.image_mean, teacher.image_std)
            tokens = batch.get("teacher_tokens", batch["text"])
            t_image, t_text = cached_features(lambda i, t: (teacher.encode_image(i), teacher.encode_text(t)),
                                              adapted, tokens, chunk_size or images.shape[0])
            return t_image, t_text, teacher.logit_scale


@dataclass(frozen=True)
class Distillation:
    """``model.init_args.distill`` (docs/distill.md): what a CLIP student learns from a frozen teacher.

    Attributes:
        teacher: a frozen CLIP teacher's file or folder (mmssl checkpoint, open_clip state dict with
            ``teacher_model``, ``open_clip_hf`` or transformers folder: :mod:`mmssl.models.teacher`),
            run online; its path and SHA-256 are saved, never its weights.
        teacher_model: the open_clip model name or JSON config of a ``teacher`` state-dict file.
        teacher_tokenizer: local folder of the teacher's Hugging Face tokenizer, if its config names one.
        embeddings: stored teacher embeddings instead (``tools/teacher_embeddings.py``'s folder).
        embed_dim: the teacher's width, recorded from it (a distilled checkpoint's projection).
        weights: weights of the terms ``contrastive``, ``logits`` (open_clip's ``DistillClipLoss``)
            and ``features`` (CLIP-KD feature distillation); default 1, 1, 0.
        feature_loss: ``cosine`` or ``mse``, the feature-distillation distance.
    """

    teacher: Optional[str] = None
    teacher_model: Optional[str] = None
    teacher_tokenizer: Optional[str] = None
    embeddings: Optional[str] = None
    embed_dim: Optional[int] = None
    weights: Optional[dict[str, float]] = None
    feature_loss: str = "cosine"


# The flat keys of configs and checkpoints written before distillation became a config group.
DISTILL_RENAMES = {"teacher": "distill.teacher", "teacher_model": "distill.teacher_model",
                   "teacher_tokenizer": "distill.teacher_tokenizer", "teacher_embeddings": "distill.embeddings",
                   "teacher_embed_dim": "distill.embed_dim", "distill_weights": "distill.weights",
                   "distill_feature_loss": "distill.feature_loss"}


def build_distiller(student_dim: int, options: Distillation) -> Optional[Distiller]:
    """The student's :class:`Distiller` from its ``distill`` options, or ``None`` without distillation.

    The teacher (or the stored embeddings' manifest) is read here, at start-up: a missing,
    unreadable or code-carrying file fails before any training. ``embed_dim`` alone (a distilled
    student rebuilt from its checkpoint, teacher not needed) keeps the projection.
    """
    teacher, embeddings, embed_dim = options.teacher, options.embeddings, options.embed_dim
    if teacher is not None and embeddings is not None:
        raise ValueError("model.init_args.distill.teacher and distill.embeddings: give one "
                         "(online, or stored embeddings)")
    weights = check_weights(options.weights)
    online = None
    if teacher is not None:
        # Building the teacher draws random initial weights (then replaced by its own): outside the
        # run's random stream, so a student starts alike with an online teacher or stored embeddings.
        with torch.random.fork_rng(devices=[]):
            online = load_teacher(teacher, options.teacher_model, options.teacher_tokenizer)
    stored = None
    if embeddings is not None:
        stored = {**read_manifest(embeddings), "folder": embeddings}
    dim = online.embed_dim if online is not None else stored["embed_dim"] if stored is not None else embed_dim
    if dim is None:
        return None
    if embed_dim is not None and int(embed_dim) != int(dim):
        raise ValueError(f"model.init_args.distill.embed_dim={embed_dim}, but the teacher's width is {dim}")
    return Distiller(student_dim, int(dim), weights, options.feature_loss, online, stored)
