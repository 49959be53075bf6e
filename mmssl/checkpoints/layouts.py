"""State-dict key layouts of mmssl's checkpoints, and the converters to other libraries' names.

One table, :data:`KINDS`, says which LightningModule a checkpoint's weights belong to (by its
recorded class path, or by its keys), which converters apply and which export formats can hold
it. Loading (:mod:`mmssl.checkpoints.load`), exporting (:mod:`mmssl.export`) and fine-tuning
initialisation (:func:`mmssl.models.vit.load_encoder`) all read it. This module imports no model:
models import it.

Layouts (a Lightning checkpoint's ``state_dict``):

* ``MAE``: ``encoder.*`` (``MaskedViT``, timm's ViT names) and ``decoder.*``.
* ``CLIP``: ``model.*``, the open_clip model (``model.logit_scale``); a timm image tower under
  ``model.visual.trunk.*``.
* ``CoCa``: ``model.*``, the open_clip ``CoCa`` (CLIP's layout plus ``model.text_decoder.*``).
* ``ImageClassifier``: ``model.*``, the timm ViT with its head (``model.head.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional

import torch
from timm.layers import resample_abs_pos_embed

StateDict = dict[str, torch.Tensor]

ENCODER = "encoder."  # MAE's MaskedViT inside the module
MODEL = "model."  # CLIP's open_clip model / ImageClassifier's timm model inside the module
CLIP_TIMM_TRUNK = "model.visual.trunk."  # open_clip's TimmModel tower inside mmssl's CLIP
DDP = "module."  # what DistributedDataParallel's own state_dict puts before every key


def strip_prefix(state: StateDict, prefix: str) -> StateDict:
    """The entries of ``state`` under ``prefix``, with the prefix removed (the others dropped)."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def strip_ddp(state: StateDict) -> StateDict:
    """``state`` without DDP's ``module.`` prefix, when every key has it."""
    if state and all(k.startswith(DDP) for k in state):
        return strip_prefix(state, DDP)
    return state


def mae_to_timm(state: StateDict) -> StateDict:
    """MAE encoder -> timm ``VisionTransformer`` (``num_classes=0, global_pool="token"``).

    ``MaskedViT`` uses timm's parameter names: the ``encoder.`` entries without the prefix; the
    decoder and mask token are pretraining-only and left out.
    """
    out = strip_prefix(state, ENCODER)
    if not out:
        raise KeyError("no 'encoder.*' weights in this checkpoint: is it an MAE checkpoint?")
    return out


def classifier_to_timm(state: StateDict) -> StateDict:
    """``ImageClassifier`` -> timm ``VisionTransformer`` state dict, head included, for
    ``timm.create_model(model_name, num_classes=N, global_pool=POOL, img_size=S, **model_kwargs)``."""
    if "model.head.weight" not in state:
        raise KeyError("no 'model.head.weight' in this checkpoint: is it an mmssl ImageClassifier checkpoint?")
    return strip_prefix(state, MODEL)


def clip_to_open_clip(state: StateDict) -> StateDict:
    """CLIP module -> plain open_clip state dict (the ``model.`` prefix dropped; FLIP masking has
    no weights), loaded strictly by the open_clip model of the same config."""
    out = strip_prefix(state, MODEL)
    if not out or "logit_scale" not in out:
        raise KeyError("no 'model.logit_scale' in this checkpoint: is it an mmssl CLIP checkpoint?")
    return out


def clip_timm_trunk(state: StateDict) -> StateDict:
    """A CLIP's timm image tower under timm's names (what a timm ViT is fine-tuned from)."""
    trunk = strip_prefix(state, CLIP_TIMM_TRUNK)
    if not trunk:
        raise ValueError("a CLIP checkpoint whose image tower is open_clip's own ViT, not a timm model; only CLIP "
                         "models with a timm tower (vision_cfg.timm_model_name) can initialise a timm ViT")
    return trunk


@dataclass(frozen=True)
class ModelKind:
    """A LightningModule mmssl builds from checkpoints, and what its weights convert to.

    Attributes:
        name: the class's short name (``--model-class`` takes it).
        class_path: where the class lives; the only classes a checkpoint is ever loaded into.
        detect: whether a ``state_dict``'s keys are this kind's (for files that record no class).
        formats: the export formats that can hold it (``tools/export.py --format``).
        vit: its image ViT under timm's names, or ``None`` (fine-tuning initialisation).
    """

    name: str
    class_path: str
    detect: Callable[[Collection[str]], bool]
    formats: tuple[str, ...]
    vit: Optional[Callable[[StateDict], StateDict]] = None


def _is_mae(keys: Collection[str]) -> bool:
    return any(k.startswith(ENCODER) for k in keys) and any(k.startswith("decoder.") for k in keys)


# The one table of model kinds. A new LightningModule adds its row (and a test in tests/test_layouts.py).
KINDS: tuple[ModelKind, ...] = (
    ModelKind("MAE", "mmssl.models.mae.MAE", _is_mae, ("timm",), mae_to_timm),
    # Before CLIP, whose detection (model.logit_scale) a CoCa's weights also pass.
    ModelKind("CoCa", "mmssl.models.coca.CoCa", lambda keys: any(k.startswith("model.text_decoder.") for k in keys),
              ("open_clip",), clip_timm_trunk),
    ModelKind("CLIP", "mmssl.models.clip.CLIP", lambda keys: "model.logit_scale" in keys,
              ("open_clip", "open_clip_hf", "hf"), clip_timm_trunk),
    ModelKind("ImageClassifier", "mmssl.models.classifier.ImageClassifier",
              lambda keys: "model.head.weight" in keys and "model.logit_scale" not in keys, ("timm",),
              classifier_to_timm),
)


def kind_named(name: str) -> Optional[ModelKind]:
    """The kind of a class name: short (``MAE``), full (``mmssl.models.mae.MAE``) or the package's
    public path (``mmssl.models.MAE``); ``None`` for any other name."""
    for kind in KINDS:
        if name in (kind.name, kind.class_path, f"mmssl.models.{kind.name}"):
            return kind
    return None


def detect_kind(keys: Collection[str]) -> Optional[ModelKind]:
    """The kind whose layout ``keys`` (a Lightning ``state_dict``'s) have, or ``None``."""
    return next((kind for kind in KINDS if kind.detect(keys)), None)


def kinds_for(format: str) -> list[str]:
    """Names of the kinds that export to ``format``."""
    return [kind.name for kind in KINDS if format in kind.formats]


def vit_weights(state: StateDict, path: str) -> StateDict:
    """A checkpoint's ViT weights under timm's names, whatever wrote it.

    Args:
        state: the file's tensors (:func:`mmssl.checkpoints.read_state_dict`): an mmssl MAE, CLIP
            (timm tower) or ImageClassifier ``state_dict``, a timm state dict or an MAE release.
        path: the file, named in errors.

    Returns:
        The state dict; extra keys (MAE's decoder, a classifier head) are left for the caller.
    """
    kind = detect_kind(state)
    if kind is not None and kind.vit is not None:
        try:
            return kind.vit(state)
        except (KeyError, ValueError) as err:
            raise type(err)(f"{path}: {err.args[0]}") from None
    if any(k.startswith(ENCODER) for k in state):  # an encoder saved without its decoder
        return strip_prefix(state, ENCODER)
    return state


def fit_vit_state(state: StateDict, own: StateDict, grid_size: tuple[int, int], num_prefix_tokens: int,
                  path: str, new_keys: Collection[str] = ()) -> tuple[StateDict, list[str], list[str]]:
    """Fit a file's ViT weights (timm names) to a model's own state dict, as MAE ``main_finetune.py``.

    A head of another shape is dropped, the position embedding resampled to the model's grid
    (timm's ``resample_abs_pos_embed``, MAE's ``interpolate_pos_embed``), keys the model lacks
    (MAE's decoder and mask token) ignored.

    Args:
        state: the file's weights (:func:`vit_weights`).
        own: the model's ``state_dict()``.
        grid_size: the model's patch grid (rows, columns).
        num_prefix_tokens: the model's cls (+ register) tokens in ``pos_embed``.
        path: the file, named in errors.
        new_keys: model keys the file need not provide (a new head, ``fc_norm``).

    Returns:
        ``(to_load, missing, ignored)``: weights for ``load_state_dict(strict=False)``, the model's
        keys left as built and the file's keys not loaded.

    Raises:
        KeyError: the file lacks weights the model has (beyond ``new_keys``).
        ValueError: a weight's shape differs (the file's ViT is another size).
    """
    state = dict(state)
    for key in ("head.weight", "head.bias"):
        if key in state and key in own and state[key].shape != own[key].shape:
            del state[key]
    pos = state.get("pos_embed")
    if pos is not None and "pos_embed" in own and pos.shape != own["pos_embed"].shape:
        state["pos_embed"] = resample_abs_pos_embed(pos, new_size=list(grid_size), num_prefix_tokens=num_prefix_tokens)
    ignored = sorted(k for k in state if k not in own)
    state = {k: v for k, v in state.items() if k in own}
    wrong = [f"{k}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items()
             if v.shape != own[k].shape]
    if wrong:
        raise ValueError(f"{path}: weights of another shape ({'; '.join(wrong[:4])}): give the model the pretrained "
                         "ViT's sizes (an ImageClassifier's model.model_kwargs: patch_size, embed_dim, depth, "
                         "num_heads, ...; an MAE's model.embed_dim, depth, ...)")
    missing = sorted(set(own) - set(state))
    lacking = [k for k in missing if k not in new_keys]
    if lacking:
        more = " ..." if len(lacking) > 8 else ""
        raise KeyError(f"{path}: the checkpoint lacks encoder weights {lacking[:8]}{more}")
    return state, missing, ignored
