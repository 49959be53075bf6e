"""The one place mmssl reads checkpoint files: tensors and plain data, never code.

``torch.load`` unpickles, and a pickle may name any importable callable (``os.system``,
``builtins.exec``) to be called while loading. Every file mmssl reads therefore goes through
:func:`read_checkpoint`: ``.safetensors`` via safetensors (no pickle at all), anything else via
``torch.load(weights_only=True)``, whose unpickler rebuilds only tensors, containers and
primitives, plus the types in :data:`SAFE_GLOBALS`. A file naming anything else is refused with
:class:`UnsafeCheckpointError` before any of it runs. Which module class to build from a Lightning
checkpoint is chosen from the table of model kinds (``mmssl.checkpoints.layouts.KINDS``), never
imported from a name the file holds.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import zipfile
from typing import Any

import torch

from mmssl.checkpoints.layouts import strip_ddp
# Types besides torch's own weights_only set that a checkpoint may pickle and mmssl accepts.
# Measured with torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints written by
# `mmssl fit` (configs/demo/{mae,clip}.yaml, ModelCheckpoint and LearningRateMonitor plus the
# always-on callbacks; Lightning 2.6, and the CLIP one under 2.2.0 too): none is needed.
# Hyper-parameters are saved as a plain dict without the optimizer callable
# (save_hyperparameters(ignore=["optimizer"])), and RNGState stores lists rather than numpy
# arrays. Keep it empty unless a checkpoint of ours needs a type, and then add only that
# pure-data type (never a callable).
SAFE_GLOBALS: tuple[Any, ...] = ()


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file pickles an object outside the allow-list; nothing of it was run."""


def _pickled_globals(path: str) -> list[str]:
    """``module.name`` of every global the pickles at the start of a legacy (non-zip) file
    refer to, read from the opcodes (``pickletools``), never executed."""
    found: list[str] = []
    with open(path, "rb") as f:
        for _ in range(4):  # torch's legacy format: magic, protocol, sys info, then the object
            strings: list[str] = []
            try:
                for opcode, arg, _pos in pickletools.genops(f):
                    if opcode.name == "GLOBAL":
                        found.append(str(arg).replace(" ", "."))
                    elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.append(".".join(strings[-2:]))
                    elif isinstance(arg, str):
                        strings.append(arg)
            except Exception:  # the raw tensor bytes after the pickles, or the end of the file
                break
    return found


def _offending_globals(path: str) -> list[str]:
    """The globals of ``path`` outside torch's weights-only set and :data:`SAFE_GLOBALS`."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: a bare pickle or torch's legacy format
        found = [
            name for name in _pickled_globals(path)
            if not name.startswith("torch.") and name != "collections.OrderedDict"
        ]
    return sorted({name for name in found if name not in allowed})


def read_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint file as plain data: tensors, dicts, lists, numbers, strings.

    Args:
        path: a ``.safetensors`` file, or a ``torch.save`` file (``.ckpt``, ``.pth``, ``.pt``,
            ``.bin``) such as a Lightning checkpoint or a bare state dict.
        mmap: map a zip-format file's tensors instead of reading them (cheap look-ups of one
            entry, e.g. ``global_step``, in a large checkpoint).

    Returns:
        The file's top-level dict (a Lightning checkpoint, or a state dict).

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeCheckpointError: the file pickles a global outside torch's weights-only set and
            :data:`SAFE_GLOBALS` (nothing in it has been executed).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    # Only zip-format files can be mapped (torch.save's default); a legacy pickle is read whole.
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            state = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        names = _offending_globals(path)
        what = ", ".join(names) if names else "content torch's weights-only unpickler does not accept"
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the file pickles {what}, which mmssl does not allow "
            "(checkpoints are read with torch.load(weights_only=True); only tensors, containers "
            "and primitives are accepted, as mmssl fit writes them). If the file is yours, re-save "
            "its state dict alone, or as .safetensors."
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a dict (checkpoint or state dict), found {type(state).__name__}")
    return state


# Lightning's WeightAveraging (mmssl.callbacks.EMA) writes the averaged weights to "state_dict",
# the raw ones to RAW_WEIGHTS and the AveragedModel's count to AVERAGING_STATE.
RAW_WEIGHTS, AVERAGING_STATE = "current_model_state", "averaging_state"


def has_averaged_weights(checkpoint: dict[str, Any]) -> bool:
    """Whether a Lightning checkpoint was written with a weight average (``mmssl.callbacks.EMA``)."""
    return isinstance(checkpoint.get(RAW_WEIGHTS), dict) and AVERAGING_STATE in checkpoint


def lightning_weights(path: str, checkpoint: dict[str, Any], ema: bool = False) -> dict[str, torch.Tensor]:
    """The raw weights of a Lightning checkpoint, or with ``ema`` its averaged ones.

    Args:
        path: the file, named in errors.
        checkpoint: its contents, with a ``state_dict``.
        ema: the EMA's weights (its ``state_dict``) instead of the raw ones (``current_model_state``
            in a checkpoint with an average, else ``state_dict``).

    Raises:
        ValueError: ``ema`` asked of a checkpoint written without an average.
    """
    if has_averaged_weights(checkpoint):
        return checkpoint["state_dict"] if ema else checkpoint[RAW_WEIGHTS]
    if ema:
        raise ValueError(f"{path}: --ema asks for averaged weights and this checkpoint holds none (no "
                         f"'{RAW_WEIGHTS}'): it was not trained with mmssl.callbacks.EMA")
    return checkpoint["state_dict"]


def read_state_dict(path: str, ema: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, unwrapped and with DDP's ``module.`` prefix removed.

    Args:
        path: see :func:`read_checkpoint`; a Lightning checkpoint (``"state_dict"``; its raw
            weights when it holds an EMA too, see :func:`lightning_weights`), an MAE release
            (``"model"``) or a bare state dict.
        ema: a Lightning checkpoint's averaged weights (refused for a file without them).

    Returns:
        The state dict, keys otherwise as stored.
    """
    state: dict[str, Any] = read_checkpoint(path)
    if isinstance(state.get("state_dict"), dict):
        return strip_ddp(lightning_weights(path, state, ema))
    if ema:
        raise ValueError(f"{path}: --ema reads a Lightning checkpoint's averaged weights; this file is no "
                         "Lightning checkpoint (no 'state_dict')")
    if isinstance(state.get("model"), dict):  # an MAE release (main_pretrain.py's save_model)
        state = state["model"]
    return strip_ddp(state)
