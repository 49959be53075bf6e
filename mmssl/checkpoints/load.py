"""A LightningModule from a checkpoint file, built as one of the kinds of the one table
(:data:`mmssl.checkpoints.layouts.KINDS`): every tool, export and probe loads through here.

The file is read as data only (:func:`mmssl.checkpoints.read_checkpoint`). Which class to build is
the table's: chosen by an explicit ``model_class``, else the class path LightningCLI records
(``hyper_parameters._class_path``), else ``model.class_path`` in the run's ``config.yaml``, else
the weights' layout; a class the table does not list is refused, never imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, Optional

import lightning.pytorch as pl
import yaml

from mmssl.checkpoints.layouts import KINDS, ModelKind, detect_kind, kind_named
from mmssl.checkpoints.read import lightning_weights, read_checkpoint
from mmssl.models.lora import BASE_ARGS, LORA_BASE, check_base, load_trained_state
from mmssl.upstream import lightning_cli_class_path


def model_class_names() -> tuple[str, ...]:
    """``--model-class`` choices: the table's classes by short name, then by class path."""
    return (*(k.name for k in KINDS), *(k.class_path for k in KINDS))


def read_lightning(path: str, ema: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint file as plain data (weights only), its ``state_dict`` the raw
    weights, or with ``ema`` the averaged ones (:func:`mmssl.checkpoints.read.lightning_weights`).

    Raises:
        FileNotFoundError: no file at ``path``.
        KeyError: the file has no ``state_dict`` (a bare state dict: load it with ``--model``).
        ValueError: ``ema`` for a checkpoint without averaged weights.
    """
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint.get("state_dict"), dict):
        raise KeyError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry): pass --model for a state dict")
    return {**checkpoint, "state_dict": lightning_weights(path, checkpoint, ema)}


def _recorded_class(path: str, checkpoint: dict[str, Any]) -> Optional[str]:
    """The class path the checkpoint, or its run's ``config.yaml`` (``run/checkpoints/x.ckpt``), records."""
    class_path = lightning_cli_class_path(checkpoint.get("hyper_parameters") or {})
    if class_path is None:
        config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")
        if os.path.isfile(config):
            with open(config) as f:
                class_path = (yaml.safe_load(f).get("model") or {}).get("class_path")
    return class_path


def checkpoint_kind(path: str, checkpoint: dict[str, Any], model_class: Optional[str] = None) -> ModelKind:
    """The table's kind of a Lightning checkpoint (see the module docstring for the order).

    Args:
        path: the file, named in errors.
        checkpoint: its contents (:func:`read_lightning`).
        model_class: a class name overriding what the file records.

    Raises:
        ValueError: a class outside the table, or a file that records none and whose weights are no kind's.
    """
    class_path = model_class or _recorded_class(path, checkpoint)
    names = sorted(model_class_names())
    if class_path:
        kind = kind_named(class_path)
        if kind is None:
            raise ValueError(f"{path}: model class {class_path!r} is not one mmssl loads checkpoints into; "
                             f"choose from {names}")
        return kind
    kind = detect_kind(checkpoint["state_dict"])
    if kind is None:
        raise ValueError(f"{path}: the checkpoint names no model class (no hyper_parameters._class_path, no "
                         f"config.yaml beside the run) and its weights are no kind mmssl knows: pass --model-class, "
                         f"one of {names}")
    return kind


def module_class(kind: ModelKind) -> type[pl.LightningModule]:
    """The class of a table row (imported from the table's path, never from a file's)."""
    module, _, name = kind.class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_module(path: str, checkpoint: dict[str, Any], kind: ModelKind) -> pl.LightningModule:
    """Build ``kind``'s module from the checkpoint's hyper-parameters and load its weights (strictly).

    ``pretrained`` / ``init_encoder`` / ``image_tower_init`` / ``zero_shot_head`` are not re-read: the
    checkpoint's weights replace whatever they would load; nor is a CLIP's distillation ``teacher`` /
    ``teacher_embeddings``. A LoRA checkpoint (``lora_base``) holds only what trained: its base is
    rebuilt from the recorded files (checksums checked, :func:`mmssl.models.lora.check_base`), then
    the adapters loaded.

    Returns:
        The module on the CPU, in eval mode.
    """
    cls = module_class(kind)
    hparams = {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if not k.startswith("_")}
    accepted = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ValueError(f"{path}: hyper-parameters {unknown} are not arguments of {cls.__name__}")
    # Neither initial weights nor a distillation teacher is needed to rebuild a trained module,
    # except the base files a LoRA checkpoint's adapters sit on.
    base = check_base(checkpoint[LORA_BASE], path) if checkpoint.get(LORA_BASE) else {}
    rebuilt_without = ("zero_shot_head", "teacher", "teacher_embeddings")
    hparams.update({k: None for k in rebuilt_without if k in accepted})
    hparams.update({k: base.get(k) for k in BASE_ARGS if k in accepted})
    module = cls(**hparams)
    if base:
        load_trained_state(module, checkpoint["state_dict"], path)
    else:
        module.load_state_dict(checkpoint["state_dict"])
    return module.eval()


def load_lightning(path: str, model_class: Optional[str] = None, ema: bool = False) -> pl.LightningModule:
    """Load an mmssl Lightning checkpoint into its kind's class, read once, weights only.

    Args:
        path: the ``.ckpt`` file.
        model_class: ``MAE`` / ``CLIP`` / ``ImageClassifier`` (or their class paths), overriding
            what the checkpoint records.
        ema: the EMA's weights (``mmssl.callbacks.EMA``) instead of the raw ones.

    Returns:
        The module on the CPU, in eval mode.
    """
    checkpoint = read_lightning(path, ema)
    return build_module(path, checkpoint, checkpoint_kind(path, checkpoint, model_class))
