"""What a model file holds, read once: its form, its kind of the one table, its init arguments and
its weights in the layout another library loads.

Every place that builds a model or an encoder from a file starts here (:func:`read_model_file`):
:mod:`mmssl.checkpoints.load` (tools, exports, WiSE-FT, evaluation), the distillation teacher
(:mod:`mmssl.models.teacher`), ``pretrained`` (:func:`mmssl.models.open_clip_config.create_model`),
``image_tower_init`` (:mod:`mmssl.models.lit`) and ``zero_shot_head``. The file is read as data
only (:func:`mmssl.checkpoints.read.read_checkpoint`). A Lightning checkpoint's kind is, in this
order: an explicit ``model_class``; the class path LightningCLI records
(``hyper_parameters._class_path``); ``model.class_path`` in the run's ``config.yaml``
(``RUN/config.yaml`` beside ``RUN/checkpoints/FILE``); the weights' layout
(:func:`mmssl.checkpoints.layouts.detect_kind`, which does not depend on the table's order). A
class the table does not list is refused, never imported. An export folder's model is built by
:func:`mmssl.checkpoints.folders.build_folder`, the one builder the teacher and the evaluation
encoders share.

This module sits below the models: it builds none. Only :func:`kind_class` imports a class, at call
time and from the table's own path (the renamed init arguments are the class's statement,
:mod:`mmssl.renames`), for callers on the models floor and above.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

import yaml

from mmssl.checkpoints.folders import folder_format
from mmssl.checkpoints.layouts import KINDS, ModelKind, StateDict, detect_kind, kind_named, strip_ddp
from mmssl.checkpoints.read import checkpoint_exists, lightning_weights, read_checkpoint
from mmssl.errors import CheckpointError
from mmssl.renames import upgrade_init_args
from mmssl.upstream import lightning_cli_class_path

# The forms a model file takes: a Lightning checkpoint (file or sharded folder), a bare state dict,
# and the export folders (open_clip's hub folder, a transformers CLIPModel folder, a timm hub folder:
# :mod:`mmssl.checkpoints.folders`, which builds their models).
LIGHTNING, STATE_DICT = "lightning", "state_dict"
RUN_CONFIG = "config.yaml"


def model_class_names() -> tuple[str, ...]:
    """``--model-class`` choices: the table's classes by short name, then by class path."""
    return (*(k.name for k in KINDS), *(k.class_path for k in KINDS))


def recorded_class(path: str, checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The class path a Lightning checkpoint records, else its run's ``config.yaml`` (``model.class_path``)."""
    class_path = lightning_cli_class_path(checkpoint.get("hyper_parameters") or {})
    if class_path is None:
        config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), RUN_CONFIG)
        if os.path.isfile(config):
            with open(config) as f:
                model = (yaml.safe_load(f) or {}).get("model")
            class_path = model.get("class_path") if isinstance(model, dict) else None
    return class_path


def checkpoint_kind(path: str, checkpoint: Mapping[str, Any], model_class: Optional[str] = None) -> ModelKind:
    """The table's kind of a Lightning checkpoint (see the module docstring for the order).

    Args:
        path: the file, named in errors.
        checkpoint: its contents, with a ``state_dict``.
        model_class: a class name overriding what the file records.

    Raises:
        ValueError: a class outside the table, or a file that records none and whose weights are
            no kind's (or several kinds').
    """
    class_path = model_class or recorded_class(path, checkpoint)
    names = sorted(model_class_names())
    if class_path:
        kind = kind_named(class_path)
        if kind is None:
            raise CheckpointError(f"{path}: model class {class_path!r} is not one mmssl loads checkpoints into; "
                                  f"choose from {names}")
        return kind
    try:
        kind = detect_kind(checkpoint["state_dict"])
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    if kind is None:
        raise CheckpointError(f"{path}: the checkpoint names no model class (no hyper_parameters._class_path, no "
                              f"config.yaml beside the run) and its weights are no kind mmssl knows: pass "
                              f"--model-class, one of {names}")
    return kind


def kind_class(kind: ModelKind) -> type:
    """The class of a table row, imported from the table's path (never from a file's)."""
    module, _, name = kind.class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: a ``**kwargs`` parameter is followed to the next
    ``__init__`` of the class's MRO, as jsonargparse follows it to the parent class."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def init_args(cls: type, hparams: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters`` as ``cls``'s init arguments: private entries dropped, renamed
    keys moved to their new names (:func:`mmssl.renames.upgrade_init_args`), each key checked.

    Raises:
        ValueError: a key that is no argument of ``cls`` (followed through ``**kwargs``).
    """
    args = upgrade_init_args(cls, {k: v for k, v in hparams.items() if not k.startswith("_")}, path)
    unknown = sorted(set(args) - init_parameters(cls))
    if unknown:
        raise CheckpointError(f"{path}: hyper-parameters {unknown} are not arguments of {cls.__name__}")
    return args


def _set_none(args: dict[str, Any], name: str) -> None:
    """Set init argument ``name`` (or ``group.key`` inside a config group) to ``None`` where given."""
    group, _, key = name.partition(".")
    if not key:
        args[name] = None
        return
    value = args.get(group)
    if isinstance(value, Mapping):
        args[group] = {**value, key: None}
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        args[group] = dataclasses.replace(value, **{key: None})


def rebuild_args(kind: ModelKind, args: Mapping[str, Any], accepted: Collection[str],
                 base: Mapping[str, str]) -> dict[str, Any]:
    """Init arguments that rebuild a trained module around its checkpoint's weights: the kind's
    file arguments (:attr:`ModelKind.file_args`) ``None``, except a LoRA base's files (``base``)."""
    out = dict(args)
    for name in kind.file_args:
        if name.partition(".")[0] in accepted:
            _set_none(out, name)
    out.update({k: base.get(k) for k in kind.base_args if k in accepted})
    return out


@dataclass
class ModelFile:
    """A model file as read (:func:`read_model_file`).

    Attributes:
        path: the file or folder.
        format: one of ``lightning``, ``state_dict``, ``open_clip_hf``, ``hf``, ``timm``.
        checkpoint: a file's contents (a Lightning checkpoint's ``state_dict`` its raw or averaged
            weights); ``{}`` for an export folder.
        kind: a Lightning checkpoint's row of the table; ``None`` otherwise.
    """

    path: str
    format: str
    checkpoint: dict[str, Any]
    kind: Optional[ModelKind] = None

    @property
    def state_dict(self) -> StateDict:
        """The weights under the module's own names (a bare state dict: as stored, DDP prefix dropped)."""
        if self.format == LIGHTNING:
            return self.checkpoint["state_dict"]
        model = self.checkpoint.get("model")  # an MAE release (main_pretrain.py's save_model)
        return strip_ddp(model if isinstance(model, dict) else self.checkpoint)

    def init_args(self) -> dict[str, Any]:
        """A Lightning checkpoint's hyper-parameters as its class's init arguments (:func:`init_args`)."""
        return init_args(kind_class(self.kind), self.checkpoint.get("hyper_parameters") or {}, self.path)

    def open_clip_state(self) -> StateDict:
        """The weights of the kind's open_clip model (what ``open_clip.create_model(name)`` loads strictly).

        Raises:
            ValueError: a kind without an open_clip model, naming the file.
        """
        if self.kind is None or self.kind.open_clip is None:
            raise CheckpointError(f"{self.path}: a {self.kind.name if self.kind else self.format} file holds no "
                                  "open_clip model")
        return self.kind.open_clip(strip_ddp(self.state_dict))

    def vit_state(self) -> StateDict:
        """The kind's image ViT under timm's names (fine-tuning initialisation).

        Raises:
            ValueError: a kind without a timm ViT, naming the file; KeyError: the weights lack it.
        """
        if self.kind is None or self.kind.vit is None:
            raise CheckpointError(f"{self.path}: a {self.kind.name if self.kind else self.format} checkpoint has no "
                                  "timm ViT image encoder")
        try:
            return self.kind.vit(strip_ddp(self.state_dict))
        except (KeyError, ValueError) as err:
            raise type(err)(f"{self.path}: {err.args[0]}") from None


def lightning_open_clip_state(path: str) -> Optional[StateDict]:
    """The open_clip weights of an mmssl Lightning checkpoint of a kind with an open_clip model (CLIP,
    CoCa: ``pretrained``), the tensors mapped, not read whole; ``None`` for any other file (an
    open_clip state dict, release or ``open_clip_train`` checkpoint, which open_clip reads itself).

    The weights are the checkpoint's ``state_dict`` as stored (of a run with ``mmssl.callbacks.EMA``,
    the average).

    Raises:
        ValueError: an mmssl checkpoint of a kind without an open_clip model (an MAE), naming it.
    """
    if path.endswith(".safetensors") or not checkpoint_exists(path):
        return None
    checkpoint = read_checkpoint(path, mmap=True)
    if not isinstance(checkpoint.get("state_dict"), dict):
        return None
    try:
        kind = checkpoint_kind(path, checkpoint)
    except ValueError:
        return None  # no mmssl kind: open_clip_train's checkpoints hold a state_dict too
    return ModelFile(path, LIGHTNING, checkpoint, kind).open_clip_state()


def read_vit_state(path: str, where: str) -> StateDict:
    """The image ViT a file holds, under timm's names (``image_tower_init``, ``init_encoder``): an mmssl
    checkpoint's by its kind's converter (:attr:`ModelKind.vit`), a state dict or an MAE release as
    stored (:func:`mmssl.checkpoints.layouts.vit_weights` reads their layout).

    Raises:
        ValueError: an export folder, or a kind without a timm ViT (naming the file).
    """
    source = read_model_file(path, where=where)
    if source.format == LIGHTNING:
        return source.vit_state()
    if source.format != STATE_DICT:
        raise CheckpointError(f"{path} is a {source.format} export folder: pass its weights file")
    return source.state_dict


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


def read_model_file(path: str, ema: bool = False, model_class: Optional[str] = None,
                    kinds: Optional[Collection[str]] = None, where: str = "--ckpt") -> ModelFile:
    """Read a model file or folder once, as data, and say what it is.

    Args:
        path: a Lightning checkpoint (file or sharded folder), a bare state dict, or an export folder
            (whose weights its loader reads, through :func:`mmssl.checkpoints.read_state_dict`).
        ema: a Lightning checkpoint's averaged weights (``mmssl.callbacks.EMA``); refused for any
            other file or folder.
        model_class: the class of a Lightning checkpoint, overriding what it records.
        kinds: the kinds the caller builds (names); a Lightning checkpoint of another is refused.
        where: the argument the path came from, named in errors.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``ema`` of a file without averaged weights, a Lightning checkpoint of no kind
            of the table or of a kind outside ``kinds``.
        UnsafeCheckpointError: the file pickles code (nothing of it ran).
    """
    if not (checkpoint_exists(path) or os.path.isdir(path)):
        raise FileNotFoundError(f"{where}: no file or folder at {path!r}")
    folder = folder_format(path)
    if folder is not None:
        if ema:
            raise CheckpointError(f"{path}: --ema reads a Lightning checkpoint's averaged weights; this {folder} "
                                  "export folder holds one set of weights (export the average with tools/export.py "
                                  "--ema)")
        return ModelFile(path, folder, {})
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint.get("state_dict"), dict):  # a bare state dict (or an MAE release)
        if ema:
            raise CheckpointError(f"{path}: --ema reads a Lightning checkpoint's averaged weights; this file is a "
                                  "state dict, which holds one set of weights")
        return ModelFile(path, STATE_DICT, checkpoint)
    checkpoint = {**checkpoint, "state_dict": lightning_weights(path, checkpoint, ema)}
    try:
        kind = checkpoint_kind(path, checkpoint, model_class)
    except ValueError as err:
        if kinds is None or model_class:
            raise
        raise CheckpointError(f"{where}: {path} is no {' or '.join(kinds)} checkpoint ({err})") from None
    if kinds is not None and kind.name not in kinds:
        raise CheckpointError(f"{where}: {path} is a {kind.name} checkpoint; this needs a {' or '.join(kinds)} "
                              "checkpoint")
    return ModelFile(path, LIGHTNING, checkpoint, kind)
