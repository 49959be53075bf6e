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
* ``CLIPMLM``: CLIP's ``model.*`` (a bidirectional text tower, one more token-embedding row for the
  mask token) plus ``mlm_head.*`` and ``itm_head.*``.
* ``ImageClassifier``: ``model.*``, the timm ViT with its head (``model.head.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
from timm.layers import resample_abs_pos_embed

from mmssl.errors import CheckpointError

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


def m3ae_to_timm(state: StateDict) -> StateDict:
    """M3AE image encoder -> timm ``VisionTransformer`` (``num_classes=0, global_pool="token"``).

    M3AE adds a learned image-modality embedding to every patch token (M3AE ``model.py``; the cls
    token has none): folded into timm's patch position embeddings, so the timm ViT computes what
    :meth:`mmssl.models.m3ae.M3AE.forward_features` computes on an image alone.
    """
    out = mae_to_timm(state)
    if "image_type" not in state:
        raise KeyError("no 'image_type' in this checkpoint: is it an M3AE checkpoint?")
    pos = out["pos_embed"].clone()  # (1, 1+L, D)
    pos[:, 1:] += state["image_type"].to(pos.dtype)  # (1, 1, D) onto every patch position
    out["pos_embed"] = pos
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


def timm_vit_name(patch_size: int, embed_dim: int, depth: int, num_heads: int, image_size: int) -> str:
    """A registered timm ViT name close to these sizes (the ``architecture`` of a timm export).

    The export's ``model_args`` carry every size, so the name only has to be a ``VisionTransformer``
    that timm builds; the nearest of timm's sizes (by width) is the most telling for readers.
    """
    import timm

    sizes = {"tiny": 192, "small": 384, "base": 768, "large": 1024, "huge": 1280}
    ordered = sorted(sizes, key=lambda s: abs(sizes[s] - embed_dim))
    for size in ordered:
        for name in (f"vit_{size}_patch{patch_size}_{image_size}", f"vit_{size}_patch{patch_size}_224",
                     f"vit_{size}_patch16_224"):
            if name in timm.list_models():
                return name
    return "vit_base_patch16_224"


def mae_timm_args(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """An MAE's timm export: ``{"architecture": name, **timm.create_model kwargs}`` from its hyper-parameters
    (``num_classes=0``, token pooling: the encoder's final-norm cls token, MAE's linear-probe feature)."""
    hp = hparams
    name = timm_vit_name(hp["patch_size"], hp["embed_dim"], hp["depth"], hp["num_heads"], hp["image_size"])
    return dict(architecture=name, img_size=hp["image_size"], patch_size=hp["patch_size"], embed_dim=hp["embed_dim"],
                depth=hp["depth"], num_heads=hp["num_heads"], mlp_ratio=hp["mlp_ratio"], num_classes=0,
                global_pool="token")


def classifier_timm_args(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """An ImageClassifier's timm export: its own timm model, head included."""
    hp = hparams
    return dict(architecture=hp["model_name"], num_classes=hp["num_classes"], global_pool=hp["global_pool"],
                img_size=hp["image_size"], **(hp.get("model_kwargs") or {}))


@dataclass(frozen=True)
class ModelKind:
    """A LightningModule mmssl builds from checkpoints, and what its weights convert to.

    Attributes:
        name: the class's short name (``--model-class`` takes it).
        class_path: where the class lives; the only classes a checkpoint is ever loaded into.
        marks: key prefixes every ``state_dict`` of this kind has (detection of files that record
            no class): a kind matches when all its marks are there, and of two that match the one
            whose marks include the other's wins (a CoCa's weights have a CLIP's marks too), so
            the table's order decides nothing.
        formats: the export formats that can hold it (``tools/export.py --format``).
        refusals: ``(format, why)`` for formats it lacks that a user may well ask for: the refusal
            says why (``mmssl.export.check_format``).
        vit: its image ViT under timm's names, or ``None`` (fine-tuning initialisation, timm export).
        open_clip: its open_clip model's weights (a distillation teacher, ``pretrained``), or ``None``.
        timm: ``hyper_parameters -> {"architecture", **timm.create_model kwargs}`` of its timm export.
        file_args: init arguments naming files that a module rebuilt from a checkpoint gets as
            ``None`` (``group.key`` inside a config group): the checkpoint's weights replace what
            they would load, a distillation teacher is not needed. A flat name and its place in a
            group are both listed; whichever the class takes is set.
        base_args: the file arguments a LoRA checkpoint's frozen base is rebuilt from (recorded in
            the checkpoint with their checksums, :func:`mmssl.models.lora.check_base`).
    """

    name: str
    class_path: str
    marks: tuple[str, ...]
    formats: tuple[str, ...] = ()
    refusals: tuple[tuple[str, str], ...] = ()
    vit: Optional[Callable[[StateDict], StateDict]] = None
    open_clip: Optional[Callable[[StateDict], StateDict]] = None
    timm: Optional[Callable[[Mapping[str, Any]], dict[str, Any]]] = None
    file_args: tuple[str, ...] = ()
    base_args: tuple[str, ...] = ()

    def detect(self, keys: Collection[str]) -> bool:
        """Whether a ``state_dict``'s keys have every mark of this kind."""
        return all(any(k.startswith(mark) for k in keys) for mark in self.marks)


# A distillation teacher's files: the flat arguments of checkpoints written before ``distill`` was a
# config group, and their places in the group. Not the whole group: ``distill.embed_dim`` keeps a
# distilled student's projection, which its weights hold.
_DISTILL = ("teacher", "teacher_embeddings", "distill.teacher", "distill.embeddings")

# The one table of model kinds. A new LightningModule adds its row; tests/checkpoints/test_layouts.py walks the
# package and fails for a LightningModule with none.
KINDS: tuple[ModelKind, ...] = (
    ModelKind("MAE", "mmssl.models.mae.MAE", (ENCODER, "decoder."), ("timm",), vit=mae_to_timm, timm=mae_timm_args,
              file_args=("init_encoder",)),
    ModelKind("M3AE", "mmssl.models.m3ae.M3AE", (ENCODER, "token_embed.", "mm_decoder."), ("timm",), vit=m3ae_to_timm,
              timm=mae_timm_args),
    ModelKind("CLIP", "mmssl.models.clip.CLIP", ("model.logit_scale",), ("open_clip", "open_clip_hf", "hf"),
              vit=clip_timm_trunk, open_clip=clip_to_open_clip,
              file_args=("pretrained", "image_tower_init", *_DISTILL), base_args=("pretrained", "image_tower_init")),
    ModelKind("CoCa", "mmssl.models.coca.CoCa", ("model.logit_scale", "model.text_decoder."), ("open_clip",),
              vit=clip_timm_trunk, open_clip=clip_to_open_clip,
              file_args=("pretrained", "image_tower_init", *_DISTILL), base_args=("pretrained", "image_tower_init")),
    # CLIP's towers (an open_clip ViT: no timm trunk) with MLM and ITM heads. Its open_clip export is the
    # CLIP alone, without the mask token's row (mmssl.export.hub.open_clip_export); `open_clip` below is the
    # model as trained, mask row included (pretrained, teacher, zero-shot head: the module's own config).
    ModelKind("CLIPMLM", "mmssl.models.clip_mlm.CLIPMLM", ("model.logit_scale", "mlm_head.", "itm_head."),
              ("open_clip", "open_clip_hf"),
              refusals=(("hf", "its text tower is bidirectional (text_cfg.no_causal_mask, for MLM) and transformers' "
                               "CLIPTextModel is causal, so it would compute other text embeddings"),
                        ("timm", "its image tower is open_clip's own ViT, not a timm model")),
              open_clip=clip_to_open_clip, file_args=("pretrained", "image_tower_init", *_DISTILL)),
    ModelKind("ImageClassifier", "mmssl.models.classifier.ImageClassifier", ("model.head.weight",), ("timm",),
              vit=classifier_to_timm, timm=classifier_timm_args, file_args=("init_encoder", "zero_shot_head"),
              base_args=("init_encoder",)),
)


def kind_named(name: str) -> Optional[ModelKind]:
    """The kind of a class name: short (``MAE``), full (``mmssl.models.mae.MAE``) or the package's
    public path (``mmssl.models.MAE``); ``None`` for any other name."""
    for kind in KINDS:
        if name in (kind.name, kind.class_path, f"mmssl.models.{kind.name}"):
            return kind
    return None


def matching_kinds(keys: Collection[str], kinds: Sequence[ModelKind] = KINDS) -> list[ModelKind]:
    """The kinds whose layout ``keys`` have, the most specific only (see :attr:`ModelKind.marks`)."""
    found = [kind for kind in kinds if kind.detect(keys)]
    return [kind for kind in found
            if not any(set(kind.marks) < set(other.marks) for other in found)]


def detect_kind(keys: Collection[str], kinds: Sequence[ModelKind] = KINDS) -> Optional[ModelKind]:
    """The kind whose layout ``keys`` (a Lightning ``state_dict``'s) have, or ``None``.

    Raises:
        ValueError: the keys fit two kinds neither of which is the more specific (name the class).
    """
    found = matching_kinds(keys, kinds)
    if len(found) > 1:
        raise ValueError(f"the weights fit several model kinds ({', '.join(k.name for k in found)}): name the class "
                         "(--model-class)")
    return found[0] if found else None


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
    try:
        kind = detect_kind(state)
        if kind is not None and kind.vit is None:
            raise ValueError(f"a {kind.name} checkpoint has no timm ViT image encoder")
        if kind is not None:
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
        raise CheckpointError(f"{path}: weights of another shape ({'; '.join(wrong[:4])}): give the model the "
                              "pretrained ViT's sizes (an ImageClassifier's model.model_kwargs: patch_size, embed_dim, "
                              "depth, num_heads, ...; an MAE's model.embed_dim, depth, ...)")
    missing = sorted(set(own) - set(state))
    lacking = [k for k in missing if k not in new_keys]
    if lacking:
        more = " ..." if len(lacking) > 8 else ""
        raise KeyError(f"{path}: the checkpoint lacks encoder weights {lacking[:8]}{more}")
    return state, missing, ignored
