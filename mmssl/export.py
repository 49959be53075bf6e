"""Turn mmssl training checkpoints into what other libraries load: state-dict files and folders.

Two kinds of format, one command line (``tools/export.py`` over :func:`export_checkpoint`):

* **State-dict files** (:data:`EXPORTERS`): a function from the Lightning checkpoint's
  ``state_dict`` to the target library's state dict, saved as ``.pth`` / ``.safetensors``
  (``timm``, ``open_clip``).
* **Folders** (:data:`FOLDER_EXPORTERS`): the module rebuilt from the checkpoint's
  hyper-parameters, written with its configs as the target library's hub folder: ``hf``
  (transformers ``CLIPModel``, :mod:`mmssl.export_hf`), ``open_clip_hf`` and ``timm``
  (:mod:`mmssl.export_hub`). ``--format timm`` writes a folder when the output has no file suffix.

Add a format by adding an entry.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from mmssl.checkpoints import read_checkpoint

StateDict = dict[str, torch.Tensor]


def to_timm(state_dict: StateDict) -> StateDict:
    """MAE encoder -> ``timm`` VisionTransformer (``num_classes=0, global_pool="token"``).

    ``MaskedViT`` already uses timm's parameter names, so this keeps the ``encoder.`` entries
    and drops the prefix; the decoder and mask token are pretraining-only and left out.

    Args:
        state_dict: a Lightning checkpoint's ``state_dict`` of an ``MAE`` module.

    Returns:
        State dict for e.g. ``timm.create_model("vit_base_patch16_224", num_classes=0,
        global_pool="token")``. An ``ImageClassifier`` checkpoint gives its whole timm model,
        head included (:func:`mmssl.models.classifier.to_timm_classifier`).
    """
    prefix = "encoder."
    if "model.head.weight" in state_dict and not any(k.startswith(prefix) for k in state_dict):
        from mmssl.models.classifier import to_timm_classifier  # the classifier imports this module

        return to_timm_classifier(state_dict)
    out = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out:
        raise KeyError("no 'encoder.*' weights in this checkpoint: is it an MAE checkpoint?")
    return out


def to_open_clip(state_dict: StateDict) -> StateDict:
    """CLIP module -> plain open_clip state dict.

    The module holds the open_clip model as ``model``, so this drops that prefix; FLIP masking
    has no weights. ``open_clip.create_model_and_transforms(NAME, pretrained=FILE)`` loads the
    result (strictly) when NAME is the config the module was built from: for a JSON config of
    ours, register it first with ``open_clip.add_model_config("path/to/name.json")``. A SigLIP
    model carries ``logit_bias``: load it into a config without one by passing
    ``init_logit_bias=-10`` to ``create_model_and_transforms`` (any value; the file's wins).

    Args:
        state_dict: a Lightning checkpoint's ``state_dict`` of a ``CLIP`` module.

    Returns:
        State dict for the open_clip model of the same config.
    """
    prefix = "model."
    out = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out or "logit_scale" not in out:
        raise KeyError("no 'model.logit_scale' in this checkpoint: is it an mmssl CLIP checkpoint?")
    return out


EXPORTERS: dict[str, Callable[[StateDict], StateDict]] = {"timm": to_timm, "open_clip": to_open_clip}


def load_lightning_state_dict(path: str) -> StateDict:
    """Read the ``state_dict`` of a Lightning checkpoint written by ``mmssl fit``.

    Args:
        path: ``.ckpt`` file.

    Returns:
        The module's state dict (``encoder.*``, ``decoder.*``, ...).

    Raises:
        mmssl.checkpoints.UnsafeCheckpointError: the file pickles anything but plain data.
    """
    checkpoint = read_checkpoint(path)  # weights only: a file that pickles code is refused
    if "state_dict" not in checkpoint:
        raise KeyError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    return checkpoint["state_dict"]


def _clip_only(module: nn.Module, format: str) -> None:
    if not hasattr(getattr(module, "model", None), "visual"):
        raise ValueError(f"--format {format} needs an mmssl CLIP checkpoint, not a {type(module).__name__} one "
                         "(an MAE encoder exports with --format timm)")


def _write_hf(module: nn.Module, output: str) -> StateDict:
    from mmssl.export_hf import write_hf  # transformers only when asked for

    _clip_only(module, "hf")
    return write_hf(module, output)


def _write_open_clip_hf(module: nn.Module, output: str) -> StateDict:
    from mmssl.export_hub import write_open_clip_hf

    _clip_only(module, "open_clip_hf")
    return write_open_clip_hf(module, output)


def _write_timm_folder(module: nn.Module, output: str) -> StateDict:
    from mmssl.export_hub import write_timm_folder

    return write_timm_folder(module, output)


FOLDER_EXPORTERS: dict[str, Callable[[nn.Module, str], StateDict]] = {
    "hf": _write_hf, "open_clip_hf": _write_open_clip_hf, "timm": _write_timm_folder,
}
FORMATS = sorted(set(EXPORTERS) | set(FOLDER_EXPORTERS))
FILE_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")

# Which allow-listed LightningModule a checkpoint's weights belong to, told by its keys (the
# file names weights, never a class to import). A new module kind adds its test here.
MODULE_KINDS: list[tuple[str, Callable[[list[str]], bool]]] = [
    ("mmssl.models.clip.CLIP", lambda keys: "model.logit_scale" in keys),
    ("mmssl.models.mae.MAE", lambda keys: any(k.startswith("encoder.") for k in keys)
                                          and any(k.startswith("decoder.") for k in keys)),
]


def load_module(ckpt: str) -> nn.Module:
    """The mmssl module of a Lightning checkpoint, rebuilt from its hyper-parameters, in eval mode.

    Raises:
        ValueError: the weights are no module kind of :data:`MODULE_KINDS`.
    """
    from mmssl.evaluation.encoders import load_lightning  # the allow-listed builder

    keys = list(load_lightning_state_dict_keys(ckpt))
    kind = next((name for name, test in MODULE_KINDS if test(keys)), None)
    if kind is None:
        raise ValueError(f"{ckpt}: its weights are none of {[n for n, _ in MODULE_KINDS]} "
                         "(no model.logit_scale, no encoder.* + decoder.*)")
    return load_lightning(ckpt, kind)


def load_lightning_state_dict_keys(path: str) -> list[str]:
    """The ``state_dict`` keys of a Lightning checkpoint, its tensors memory-mapped (not read)."""
    checkpoint = read_checkpoint(path, mmap=True)
    if "state_dict" not in checkpoint:
        raise KeyError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    return list(checkpoint["state_dict"])


def export_checkpoint(ckpt: str, format: str, output: str) -> StateDict:
    """Convert ``ckpt`` to ``format`` and save it to ``output``.

    Args:
        ckpt: Lightning checkpoint path.
        format: a key of :data:`EXPORTERS` or :data:`FOLDER_EXPORTERS`.
        output: destination; a state-dict format writes ``.safetensors`` for that suffix, else
            ``torch.save``; a folder format writes the folder ``output`` (``timm``: a folder
            when ``output`` has none of :data:`FILE_SUFFIXES`).

    Returns:
        The exported state dict.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose from {FORMATS}")
    if format in FOLDER_EXPORTERS and (format not in EXPORTERS or not output.endswith(FILE_SUFFIXES)):
        if output.endswith(FILE_SUFFIXES) or os.path.isfile(output):
            raise ValueError(f"--format {format} writes a folder: --output {output!r} names a file")
        return FOLDER_EXPORTERS[format](load_module(ckpt), output)
    state = EXPORTERS[format](load_lightning_state_dict(ckpt))
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, output)
    else:
        torch.save(state, output)
    return state
