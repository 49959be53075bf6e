"""A LightningModule from a checkpoint file, built as one of the kinds of the one table
(:data:`mmssl.checkpoints.layouts.KINDS`): every tool, export and probe loads through here.

The file is read, its kind chosen and its hyper-parameters read as init arguments on the floor below
the models (:mod:`mmssl.checkpoints.model_file`, which the model-side loaders use too: the teacher,
``pretrained``, ``image_tower_init``, ``zero_shot_head``); here the LightningModule is built.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from mmssl.checkpoints.layouts import ModelKind, StateDict, kind_named
from mmssl.checkpoints.model_file import (
    checkpoint_kind,
    init_args,
    init_parameters,
    kind_class,
    model_class_names,
    read_lightning,
    rebuild_args,
)
from mmssl.models.lora import LORA_BASE, check_base, load_trained_state, match_installed_peft

__all__ = ["build_from_args", "build_module", "checkpoint_kind", "load_lightning", "model_class_names", "module_class",
           "open_clip_module", "read_lightning"]


def module_class(kind: ModelKind) -> type[pl.LightningModule]:
    """The class of a table row (imported from the table's path, never from a file's)."""
    return kind_class(kind)


def build_from_args(kind: ModelKind, hparams: dict[str, Any], path: str, **given: Any) -> pl.LightningModule:
    """``kind``'s module from a checkpoint's hyper-parameters (renamed keys moved, each checked),
    with ``given`` init arguments over them; no weights loaded."""
    cls = module_class(kind)
    return cls(**{**init_args(cls, hparams, path), **given})


def build_module(path: str, checkpoint: dict[str, Any], kind: ModelKind) -> pl.LightningModule:
    """Build ``kind``'s module from the checkpoint's hyper-parameters and load its weights (strictly).

    The hyper-parameters are read as the class's init arguments (renamed keys moved,
    :func:`mmssl.checkpoints.model_file.init_args`). The kind's file arguments
    (:attr:`~mmssl.checkpoints.layouts.ModelKind.file_args`: ``pretrained``, ``init_encoder``,
    ``image_tower_init``, ``zero_shot_head``, a distillation teacher) are not re-read: the
    checkpoint's weights replace whatever they would load. A LoRA checkpoint (``lora_base``) holds
    only what trained: its base is rebuilt from the recorded files (checksums checked,
    :func:`mmssl.models.lora.check_base`), then the adapters loaded.

    Returns:
        The module on the CPU, in eval mode.
    """
    cls = module_class(kind)
    args = init_args(cls, checkpoint.get("hyper_parameters") or {}, path)
    base = check_base(checkpoint[LORA_BASE], path) if checkpoint.get(LORA_BASE) else {}
    module = cls(**rebuild_args(kind, args, init_parameters(cls), base))
    if base:
        match_installed_peft(module, checkpoint, path)  # adapters written under another peft
        load_trained_state(module, checkpoint["state_dict"], path)
    else:
        module.load_state_dict(checkpoint["state_dict"])
    return module.eval()


def open_clip_module(path: str, model_name: str, state: StateDict) -> pl.LightningModule:
    """The table's CLIP module around open_clip model ``model_name``, its open_clip weights ``state``
    (a state-dict file's, ``path``) loaded strictly.

    Returns:
        The module on the CPU, in eval mode.
    """
    module = build_from_args(kind_named("CLIP"), {"model_name": model_name}, path)
    module.model.load_state_dict(state)
    return module.eval()


def load_lightning(path: str, model_class: Optional[str] = None, ema: bool = False) -> pl.LightningModule:
    """Load an mmssl Lightning checkpoint into its kind's class, read once, weights only.

    Args:
        path: the ``.ckpt`` file (or a sharded checkpoint folder).
        model_class: a class of the table (short name or class path), overriding what the
            checkpoint records.
        ema: the EMA's weights (``mmssl.callbacks.EMA``) instead of the raw ones.

    Returns:
        The module on the CPU, in eval mode.
    """
    checkpoint = read_lightning(path, ema)
    return build_module(path, checkpoint, checkpoint_kind(path, checkpoint, model_class))
