"""Hub-style folders of mmssl checkpoints: what ``open_clip`` and ``timm`` load from a directory.

* ``open_clip_hf``: ``open_clip_config.json`` (``model_cfg`` + ``preprocess_cfg``) and
  ``open_clip_model.safetensors``, the files open_clip's ``push_to_hf_hub`` writes and its
  ``local-dir:`` / ``hf-hub:`` schemas read: ``open_clip.create_model_and_transforms("local-dir:DIR")``.
* ``timm``: ``model.safetensors`` and ``config.json`` (``architecture``, ``model_args``,
  ``pretrained_cfg``), written by timm's own ``save_for_hf``:
  ``timm.create_model("local-dir:DIR", pretrained=True)``, or
  ``timm.create_model(ARCH, pretrained=True, pretrained_cfg_overlay=dict(file=".../model.safetensors"), **model_args)``.

Writing the folder is the product; uploading is ``huggingface-cli upload NAME DIR``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from mmssl.checkpoints.layouts import (
    KINDS,
    StateDict,
    kind_named,
    timm_vit_name,  # noqa: F401  (public here too)
)


def _clean(state: StateDict) -> StateDict:
    """Detached, contiguous, unshared tensors (safetensors refuses shared storage)."""
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


# ---- open_clip ------------------------------------------------------------------------------


def open_clip_config(module: nn.Module) -> dict:
    """The open_clip ``model_cfg`` that rebuilds ``module.model`` (an mmssl ``CLIP`` or ``CLIPMLM``).

    open_clip's registered config for the module's ``model_name``, plus ``init_logit_bias`` when
    the model has a bias (SigLIP), so that ``create_model`` builds the ``logit_bias`` parameter
    the weights hold (its value comes from the weights).
    """
    import open_clip

    from mmssl.models.clip import resolve_model_name

    cfg = open_clip.get_model_config(resolve_model_name(module.hparams["model_name"]))
    if cfg is None:
        raise ValueError(f"open_clip has no config for {module.hparams['model_name']!r}")
    if getattr(module.model, "logit_bias", None) is not None:
        cfg["init_logit_bias"] = float(module.model.logit_bias.detach().reshape(-1)[0])
    return cfg


def plain_text_rows(module: nn.Module) -> Optional[int]:
    """The rows of a CLIPMLM's token embedding that its tokenizer's ids reach, when its mask token is a
    row added past them (open_clip's BPE: ids 0..49407, the mask 49408); ``None`` otherwise (a CLIP,
    or a Hugging Face tokenizer whose own ``[MASK]`` lies inside its vocabulary).

    The mask token only ever enters the text tower in MLM's corrupted captions; an ordinary caption
    never holds it, and argmax pooling (at the end-of-text id, the largest the tokenizer writes)
    never reaches it. Without its row the text tower is the plain open_clip one of the BPE
    vocabulary (``text_cfg.vocab_size`` 49408), and gives the same embeddings."""
    from mmssl.models.clip_mlm import CLIPMLM

    if not isinstance(module, CLIPMLM):
        return None
    vocabulary = module.vocabulary
    return vocabulary.random_vocab if vocabulary.mask_id >= vocabulary.random_vocab else None


def open_clip_export(module: nn.Module) -> tuple[StateDict, dict]:
    """The open_clip model of an mmssl ``CLIP`` or ``CLIPMLM``: its weights and the ``model_cfg``
    that rebuilds it (:func:`open_clip_config`), for ``create_model(...)`` to load strictly.

    A CLIPMLM's is its CLIP alone: the MLM and ITM heads are left out, and so is the mask token's
    embedding row where the tokenizer has no id for it (:func:`plain_text_rows`; ``vocab_size`` in
    the config follows). The config keeps ``text_cfg.no_causal_mask``: the tower was trained
    bidirectional, and open_clip rebuilds it so.
    """
    state = _clean(module.model.state_dict())
    config = open_clip_config(module)
    rows = plain_text_rows(module)
    if rows is not None:
        state["token_embedding.weight"] = state["token_embedding.weight"][:rows].clone()  # (V, W) -> (rows, W)
        config["text_cfg"]["vocab_size"] = rows
    return state, config


def write_open_clip_hf(module: nn.Module, output: str) -> StateDict:
    """Write an mmssl ``CLIP`` or ``CLIPMLM`` as an open_clip hub folder (:func:`open_clip_export`).

    Args:
        module: the ``CLIP`` or ``CLIPMLM`` LightningModule, weights loaded.
        output: folder to write (created).

    Returns:
        The saved state dict.
    """
    from open_clip.push_to_hf_hub import save_config_for_hf  # open_clip's own config writer
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    state, config = open_clip_export(module)
    save_file(state, os.path.join(output, "open_clip_model.safetensors"))
    # preprocess_cfg: the image mean and std open_clip's transforms read back (size: model_cfg).
    save_config_for_hf(module.model, Path(output, "open_clip_config.json"), model_config=config)
    return state


# ---- timm -----------------------------------------------------------------------------------


@dataclass
class TimmExport:
    """A timm model holding the exported weights, and what rebuilds it.

    Attributes:
        model: the timm model (weights loaded strictly).
        model_args: ``timm.create_model`` keyword arguments beside the architecture name.
        model_config: extra ``config.json`` fields (``label_names``, ...) for timm's writer.
    """

    model: nn.Module
    model_args: dict
    model_config: dict = field(default_factory=dict)


def mmssl_pretrained_cfg(module: nn.Module, architecture: str, image_size: int, num_classes: int, source: str) -> dict:
    """The ``pretrained_cfg`` of an exported model: its normalisation and size (for timm's
    ``resolve_data_config``), tagged as mmssl's and naming the checkpoint file. Built afresh rather
    than from the registered name's cfg, whose tag, hub id and licence describe timm's weights."""
    return {
        "architecture": architecture, "tag": "mmssl", "custom_load": False,
        "description": f"mmssl {type(module).__name__} checkpoint {os.path.basename(source)}, "
                       "exported with tools/export.py",
        "input_size": (3, image_size, image_size), "fixed_input_size": True, "interpolation": "bicubic",
        "crop_pct": 1.0, "crop_mode": "center", "mean": tuple(module.image_mean), "std": tuple(module.image_std),
        "num_classes": num_classes, "first_conv": "patch_embed.proj", "classifier": "head",
    }


def timm_export(module: nn.Module, source: str) -> TimmExport:
    """The timm model of an mmssl module whose kind's row of the table has one
    (:attr:`mmssl.checkpoints.layouts.ModelKind.timm`: its architecture and arguments; ``vit``: its
    weights under timm's names, loaded strictly): an MAE's encoder, an ImageClassifier head included.

    Raises:
        ValueError: a module whose kind has no timm model, naming the kinds that have one.
    """
    import timm

    kind = kind_named(f"{type(module).__module__}.{type(module).__qualname__}")
    if kind is None or kind.timm is None:
        raise ValueError(f"--format timm: a {type(module).__name__} checkpoint has no timm image model "
                         f"(these do: {sorted(TIMM_MODELS)}; CLIP checkpoints: --format open_clip, open_clip_hf or hf)")
    args = kind.timm(module.hparams)
    architecture = args.pop("architecture")
    model = timm.create_model(architecture, pretrained=False, **args)
    model.load_state_dict(kind.vit(module.state_dict()), strict=True)
    model.pretrained_cfg = mmssl_pretrained_cfg(module, architecture, args["img_size"], args["num_classes"], source)
    return TimmExport(model.eval(), {"architecture": architecture, **args})


# The kinds with a timm model: the rows of mmssl.checkpoints.layouts.KINDS that say how to build one.
TIMM_MODELS: dict[str, Callable[[nn.Module, str], TimmExport]] = {
    kind.name: timm_export for kind in KINDS if kind.timm is not None
}


def write_timm_folder(module: nn.Module, output: str, source: str = "") -> StateDict:
    """Write a timm hub folder (``model.safetensors`` + ``config.json``) with timm's own writer.

    Args:
        module: an mmssl LightningModule of a kind :data:`TIMM_MODELS` has.
        output: folder to write (created).
        source: the checkpoint file, named in ``pretrained_cfg.description``.

    Returns:
        The saved state dict.
    """
    from timm.models import save_for_hf  # timm's push_to_hf_hub writer, without the upload

    export = timm_export(module, source)
    args = dict(export.model_args)
    architecture = args.pop("architecture")
    save_for_hf(export.model, output, model_config=dict(export.model_config), model_args=args, safe_serialization=True)
    # timm records only the reconstruction arguments its factory saw; write ours in full, so
    # that local-dir: rebuilds these sizes whatever the registered name's defaults.
    path = os.path.join(output, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["architecture"] = architecture
    config["model_args"] = {**config.get("model_args", {}), **args}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return export.model.state_dict()
