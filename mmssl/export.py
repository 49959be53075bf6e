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
import shutil
import tempfile
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


# The files the folder formats write (timm's save_for_hf; open_clip's hub files; transformers'
# CLIPModel, processor and tokenizer). ``--overwrite`` replaces a folder holding only these, so
# that it never deletes a file an export did not write.
EXPORT_FILE_NAMES = frozenset({
    "config.json", "model.safetensors", "open_clip_config.json", "open_clip_model.safetensors",
    "preprocessor_config.json", "processor_config.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.json", "generation_config.json", "chat_template.jinja", "README.md",
})


def check_output(output: str, folder: bool, overwrite: bool = False) -> None:
    """Refuse an export destination before anything is read or written.

    Args:
        output: the file or folder to write.
        folder: the format writes a folder (else one state-dict file).
        overwrite: replace an existing file, or a folder holding only :data:`EXPORT_FILE_NAMES`.

    Raises:
        FileExistsError: ``output`` exists (a file, or a non-empty folder) and ``overwrite`` is off,
            or it holds files no export writes.
        IsADirectoryError / NotADirectoryError: a folder where a file goes, or the other way round.
    """
    parent = os.path.dirname(os.path.abspath(output))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"--output {output!r}: {parent!r} is a file, not a folder")
    if not folder:
        if os.path.isdir(output) or output.endswith(("/", os.sep)):
            raise IsADirectoryError(f"--output {output!r} is a folder; this format writes one state-dict file "
                                    "(name a .pth or .safetensors file)")
        if os.path.lexists(output) and not overwrite:
            raise FileExistsError(f"--output {output!r} exists: pass --overwrite to replace it")
        return
    if os.path.lexists(output) and not os.path.isdir(output):
        raise NotADirectoryError(f"--output {output!r} is a file; this format writes a folder")
    entries = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"--output {output!r} is a folder that is not empty ({', '.join(entries[:5])}"
                              f"{' ...' if len(entries) > 5 else ''}): name a new or empty folder, or pass --overwrite")
    foreign = [e for e in entries if e not in EXPORT_FILE_NAMES or not os.path.isfile(os.path.join(output, e))]
    if foreign:
        raise FileExistsError(f"--output {output!r} holds {foreign[:5]}, which no export writes: --overwrite "
                              "replaces only a folder of an earlier export; name a new or empty folder")


def _umask_mode(path: str, folder: bool) -> None:
    """Give a temporary file or folder (created 0600 / 0700) the mode a plain ``open`` / ``mkdir``
    would have given it under the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if folder else 0o666) & ~mask)


def save_state_file(state: StateDict, output: str) -> None:
    """Save a state dict to ``output`` through a temporary file beside it, then ``os.replace``
    (a failed write leaves an existing file whole). ``.safetensors`` by suffix, else ``torch.save``."""
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        if output.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(state, tmp)
        else:
            torch.save(state, tmp)
        _umask_mode(tmp, folder=False)
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise


def write_folder(output: str, write: Callable[[str], StateDict]) -> StateDict:
    """Run ``write`` into a new folder beside ``output``, then put it in ``output``'s place (an
    earlier export there, checked by :func:`check_output`, is removed only once the new one is whole).

    Returns:
        What ``write`` returns.
    """
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.", dir=parent)
    try:
        state = write(tmp)
        _umask_mode(tmp, folder=True)
        if os.path.isdir(output) and os.listdir(output):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.old.", dir=parent)
            os.replace(output, old)  # onto the empty folder just made
            os.replace(tmp, output)
            shutil.rmtree(old)
        else:
            os.replace(tmp, output)  # an empty folder at output is replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return state


def export_checkpoint(ckpt: str, format: str, output: str, overwrite: bool = False) -> StateDict:
    """Convert ``ckpt`` to ``format`` and save it to ``output``.

    Nothing is written until the destination is checked (:func:`check_output`), and then through a
    temporary file or folder beside it, so a refused or failed export leaves ``output`` as it was.

    Args:
        ckpt: Lightning checkpoint path.
        format: a key of :data:`EXPORTERS` or :data:`FOLDER_EXPORTERS`.
        output: destination; a state-dict format writes ``.safetensors`` for that suffix, else
            ``torch.save``; a folder format writes the folder ``output`` (``timm``: a folder
            when ``output`` has none of :data:`FILE_SUFFIXES` or is a folder already).
        overwrite: replace an existing file, or a folder of an earlier export.

    Returns:
        The exported state dict.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose from {FORMATS}")
    if not os.path.isfile(ckpt):
        raise FileNotFoundError(f"--ckpt: no checkpoint file at {ckpt!r}")
    folder = format in FOLDER_EXPORTERS and (
        format not in EXPORTERS or os.path.isdir(output) or not output.endswith(FILE_SUFFIXES))
    if folder and output.endswith(FILE_SUFFIXES) and not os.path.isdir(output):
        raise ValueError(f"--format {format} writes a folder: --output {output!r} names a file")
    check_output(output, folder, overwrite)
    if folder:
        module = load_module(ckpt)
        return write_folder(output, lambda tmp: FOLDER_EXPORTERS[format](module, tmp))
    state = EXPORTERS[format](load_lightning_state_dict(ckpt))
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    save_state_file(state, output)
    return state
