"""Turn mmssl training checkpoints into plain state dicts other libraries load.

``EXPORTERS`` maps a format name to a function from the Lightning checkpoint's ``state_dict`` to
the target library's state dict; ``tools/export.py`` is a thin command line over
:func:`export_checkpoint`. Add a format by adding an entry.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

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
        global_pool="token")``.
    """
    prefix = "encoder."
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


def export_checkpoint(ckpt: str, format: str, output: str) -> StateDict:
    """Convert ``ckpt`` to ``format`` and save it to ``output``.

    Args:
        ckpt: Lightning checkpoint path.
        format: a key of :data:`EXPORTERS`.
        output: destination; ``.safetensors`` writes safetensors, anything else ``torch.save``.

    Returns:
        The exported state dict.
    """
    if format not in EXPORTERS:
        raise ValueError(f"unknown export format {format!r}; choose from {sorted(EXPORTERS)}")
    state = EXPORTERS[format](load_lightning_state_dict(ckpt))
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, output)
    else:
        torch.save(state, output)
    return state
