"""WiSE-FT's zero-shot head (Wortsman et al. 2022): a classifier head made from a CLIP's text
embeddings of the class prompts, so that fine-tuning starts from the zero-shot model.

``mlfoundations/wise-ft`` ``src/models/zeroshot.py`` builds the head as ``logit_scale x`` the
averaged, normalised prompt embeddings (a (C, D) matrix over CLIP's D-dim image embedding), and
``ClassificationHead`` normalises the image embedding before it. A timm ViT's head reads the
trunk's pooled feature instead (width W, before CLIP's projection), so here the projection is
folded in: with the CLIP image embedding ``e = P f + b`` of the pooled feature ``f``,

    head.weight = s T^T P   (C, W),    head.bias = s T^T b   (C,)

where ``T`` is the (D, C) matrix of class embeddings and ``s`` the logit scale. Then
``head(f) = s T^T e``, the CLIP's zero-shot logits times ``|e|`` (the classifier has no
normalisation layer, timm's head is one Linear): every image's scores are the CLIP's scaled by a
positive number, so the predictions at step 0 are exactly the CLIP's zero-shot predictions
(tests/models/test_zero_shot_head.py), and the fine-tuned classifier exports to timm unchanged.
"""

from __future__ import annotations

import os
from typing import Optional

import open_clip
import torch
from open_clip.zero_shot_classifier import build_zero_shot_classifier
from torch import Tensor, nn

from mmssl.checkpoints.layouts import KINDS
from mmssl.checkpoints.model_file import LIGHTNING, read_model_file
from mmssl.checkpoints.read import checkpoint_exists
from mmssl.data.label_files import DEFAULT_TEMPLATES, TEMPLATES_FILE, read_classnames, read_templates
from mmssl.models.open_clip_config import build_tokenizer, create_model, resolve_model_name

# The kinds whose open_clip model's prompts make a head (CLIP; CoCa's contrastive towers).
OPEN_CLIP_KINDS = tuple(kind.name for kind in KINDS if kind.open_clip is not None)


def _image_projection(visual: nn.Module, path: str) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(P, b)`` of a timm tower's linear map from the pooled trunk feature to the embedding
    (``None`` for an identity); a non-linear projection is refused."""
    head = getattr(visual, "head", None)
    proj = getattr(head, "proj", None) if head is not None else None
    # open_clip TimmModel.head: drop + proj (timm_proj linear), mlp (timm_proj mlp), pool (attention pools).
    if head is not None and any(n in ("mlp", "pool") for n, _ in head.named_children()):
        raise ValueError(f"{path}: the CLIP's image projection is not linear (timm_proj: mlp or an attention "
                         "pool): it cannot be folded into a classifier head; use timm_proj linear or none")
    if isinstance(proj, nn.Linear):
        return proj.weight.detach(), None if proj.bias is None else proj.bias.detach()
    trunk_head = getattr(visual.trunk, "head", None)
    if isinstance(trunk_head, nn.Linear):  # timm_proj "none" with embed_dim: the trunk's own head projects
        return trunk_head.weight.detach(), None if trunk_head.bias is None else trunk_head.bias.detach()
    return None, None


@torch.no_grad()
def clip_zero_shot_head(path: str, classnames: str, templates: Optional[str] = None,
                        global_pool: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """The (C, W) weight and (C,) bias of a classifier head equal in predictions to a CLIP's
    zero-shot classifier (see the module docstring).

    Args:
        path: an mmssl CLIP checkpoint whose image tower is a timm model.
        classnames: a class-names file (one name a line, in label order) or a labelled set.
        templates: a templates file (``{c}``); ``None``: the set's, else CLIP's 80 ImageNet prompts.
        global_pool: the classifier's pooling, checked against the CLIP tower's ``timm_pool``.

    Raises:
        FileNotFoundError: no checkpoint or class-names file.
        ValueError: not a CLIP with a timm tower, a non-linear projection, or another pooling.
    """
    if not checkpoint_exists(path):
        raise FileNotFoundError(f"model.zero_shot_head: no checkpoint file at {path!r}")
    source = read_model_file(path, kinds=OPEN_CLIP_KINDS, where="model.zero_shot_head")
    if source.format != LIGHTNING:
        raise KeyError(f"{path}: no hyper_parameters.model_name: the zero-shot head needs an mmssl CLIP checkpoint")
    hparams = source.init_args()
    if "model_name" not in hparams:
        raise KeyError(f"{path}: no hyper_parameters.model_name: the zero-shot head needs an mmssl CLIP checkpoint")
    name = resolve_model_name(hparams["model_name"])
    clip = create_model(name, output_dict=True)
    if not hasattr(clip.visual, "trunk"):
        raise ValueError(f"{path}: the CLIP's image tower is open_clip's own ViT, not a timm model: an "
                         "ImageClassifier (a timm ViT) can start only from a CLIP with a timm tower")
    clip.load_state_dict(source.open_clip_state())
    pool = open_clip_vision_pool(name)
    if global_pool is not None and pool != global_pool:
        raise ValueError(f"model.global_pool={global_pool!r} but the CLIP tower of {path} pools with timm_pool="
                         f"{pool!r}: set model.global_pool to {pool!r} so the classifier's features are the CLIP's")
    folder = os.path.dirname(os.path.abspath(classnames)) if os.path.isfile(classnames) else classnames
    names = read_classnames(folder, classnames if os.path.isfile(classnames) else None)
    prompts = read_templates(folder, templates) if templates or not os.path.isfile(classnames) else _beside(folder)
    tokenizer = build_tokenizer(name, hparams.get("tokenizer"))
    text = build_zero_shot_classifier(clip, tokenizer, names, [lambda c, t=t: t.format(c=c) for t in prompts],
                                      num_classes_per_batch=max(1, 256 // len(prompts)), device="cpu")  # (D, C)
    scale = clip.logit_scale.exp()
    proj, bias = _image_projection(clip.visual, path)
    weight = scale * text.T @ proj if proj is not None else scale * text.T  # (C, D) @ (D, W) -> (C, W)
    head_bias = scale * text.T @ bias if bias is not None else torch.zeros(len(names))
    return weight.float(), head_bias.float()


def _beside(folder: str) -> list[str]:
    """The templates file beside a class-names file, else CLIP's 80 ImageNet prompts."""
    path = os.path.join(folder, TEMPLATES_FILE)
    return read_templates(folder, path) if os.path.isfile(path) else list(DEFAULT_TEMPLATES)


def open_clip_vision_pool(name: str) -> str:
    """The ``timm_pool`` of an open_clip config's timm tower (open_clip's default: ``avg``)."""
    return open_clip.get_model_config(name)["vision_cfg"].get("timm_pool", "avg")


def init_zero_shot_head(head: nn.Linear, path: str, classnames: Optional[str], templates: Optional[str] = None,
                        global_pool: Optional[str] = None) -> None:
    """Fill a classifier's ``head`` in place with :func:`clip_zero_shot_head`.

    Raises:
        ValueError: no ``classnames``, or another number of classes or feature width than the head's.
    """
    if not classnames:
        raise ValueError("model.zero_shot_head needs model.head_classnames: the class-names file (or labelled set) "
                         "whose prompts make the head")
    weight, bias = clip_zero_shot_head(path, classnames, templates, global_pool)
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise ValueError(f"model.zero_shot_head: {path} with {classnames} gives a head of shape {tuple(weight.shape)} "
                         f"(classes, width), the classifier's is {tuple(head.weight.shape)}: check model.num_classes "
                         "and that model.model_name / model_kwargs are the CLIP tower's")
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
