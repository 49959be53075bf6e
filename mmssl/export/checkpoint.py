"""Turn an mmssl training checkpoint into what another library loads: state-dict files and folders.

Two kinds of format, one entry point (:func:`export_checkpoint`, ``tools/export.py``):

* **State-dict files** (:data:`EXPORTERS`): the Lightning ``state_dict`` under the target
  library's names (:mod:`mmssl.checkpoints.layouts`), saved as ``.pth`` / ``.safetensors``
  (``timm``, ``open_clip``); a CLIPMLM's open_clip file from its module rebuilt
  (:data:`MODULE_FILE_EXPORTERS`: only its tokenizer says which embedding row is the mask token's).
* **Folders** (:data:`FOLDER_EXPORTERS`): the module rebuilt from the checkpoint's
  hyper-parameters, written with its configs as the target library's hub folder: ``hf``
  (transformers ``CLIPModel``, :mod:`mmssl.export.hf`), ``open_clip_hf`` and ``timm``
  (:mod:`mmssl.export.hub`). ``--format timm`` writes a folder when the output has no file
  suffix (or is a folder).

Which kinds a format holds is the ``formats`` column of :data:`mmssl.checkpoints.layouts.KINDS`;
any other pair is refused, naming the formats the kind has.
"""

from __future__ import annotations

import os
from typing import Callable

from torch import nn

from mmssl.checkpoints.layouts import ModelKind, StateDict, clip_to_open_clip, detect_kind, kinds_for
from mmssl.checkpoints.load import build_module, checkpoint_kind, read_lightning
from mmssl.checkpoints.read import checkpoint_exists
from mmssl.export.merge import merged_checkpoint
from mmssl.export.paths import check_output, save_state_file, write_folder


def to_timm(state_dict: StateDict) -> StateDict:
    """An MAE's encoder (``num_classes=0, global_pool="token"``) or an ImageClassifier's whole ViT,
    head included, under timm's ``VisionTransformer`` names.

    Args:
        state_dict: a Lightning checkpoint's ``state_dict`` of an ``MAE`` or ``ImageClassifier``.

    Returns:
        State dict for ``timm.create_model(...)`` with the module's sizes, loaded strictly.
    """
    kind = detect_kind(state_dict)
    if kind is None or "timm" not in kind.formats:
        raise KeyError("no 'encoder.*' (MAE) or 'model.head.*' (ImageClassifier) weights in this checkpoint: "
                       f"--format timm holds {' or '.join(kinds_for('timm'))} checkpoints")
    return kind.vit(state_dict)


def to_open_clip(state_dict: StateDict) -> StateDict:
    """CLIP or CoCa module -> plain open_clip state dict (:func:`mmssl.checkpoints.layouts.clip_to_open_clip`).

    ``open_clip.create_model_and_transforms(NAME, pretrained=FILE)`` loads the result (strictly)
    when NAME is the config the module was built from: for a JSON config of ours, register it
    first with ``open_clip.add_model_config("path/to/name.json")``. A SigLIP model carries
    ``logit_bias``: load it into a config without one by passing ``init_logit_bias=-10`` to
    ``create_model_and_transforms`` (any value; the file's wins).

    A CLIPMLM's file is written from its module instead (:data:`MODULE_FILE_EXPORTERS`).
    """
    return clip_to_open_clip(state_dict)


def _open_clip_of_module(module: nn.Module) -> StateDict:
    from mmssl.export.hub import open_clip_export

    return open_clip_export(module)[0]


EXPORTERS: dict[str, Callable[[StateDict], StateDict]] = {"timm": to_timm, "open_clip": to_open_clip}
# (format, kind) -> the file's state dict from the module rebuilt from the checkpoint: a CLIPMLM's
# open_clip model leaves out the mask token's embedding row, and only its tokenizer says which row
# that is (mmssl.export.hub.plain_text_rows); the state dict alone does not.
MODULE_FILE_EXPORTERS: dict[tuple[str, str], Callable[[nn.Module], StateDict]] = {
    ("open_clip", "CLIPMLM"): _open_clip_of_module,
}


def _write_hf(module: nn.Module, output: str, source: str) -> StateDict:
    # transformers only when asked for; the SigLIP writer builds on the CLIP one's pieces, so the
    # choice between them is made here, not inside either.
    from mmssl.export.hf import write_hf
    from mmssl.export.hf_siglip import is_siglip_shaped, write_siglip

    return write_siglip(module, output) if is_siglip_shaped(module.model) else write_hf(module, output)


def _write_open_clip_hf(module: nn.Module, output: str, source: str) -> StateDict:
    from mmssl.export.hub import write_open_clip_hf

    return write_open_clip_hf(module, output)


def _write_timm_folder(module: nn.Module, output: str, source: str) -> StateDict:
    from mmssl.export.hub import write_timm_folder

    return write_timm_folder(module, output, source)


# format -> writer(module, folder, checkpoint path)
FOLDER_EXPORTERS: dict[str, Callable[[nn.Module, str, str], StateDict]] = {
    "hf": _write_hf, "open_clip_hf": _write_open_clip_hf, "timm": _write_timm_folder,
}
FORMATS = sorted(set(EXPORTERS) | set(FOLDER_EXPORTERS))
FILE_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


def check_format(kind: ModelKind, format: str) -> None:
    """Refuse a format the kind's row of the table does not list, naming those it does (and why
    not this one, where the row says: :attr:`mmssl.checkpoints.layouts.ModelKind.refusals`)."""
    if format not in kind.formats:
        why = dict(kind.refusals).get(format)
        has = f"exports with --format {' / '.join(kind.formats)}" if kind.formats else "has no export format"
        raise ValueError(f"--format {format} needs an mmssl {' or '.join(kinds_for(format))} checkpoint, not a "
                         f"{kind.name} one{f': {why}' if why else ''} ({kind.name} {has})")


def export_checkpoint(ckpt: str, format: str, output: str, overwrite: bool = False, ema: bool = False) -> StateDict:
    """Convert ``ckpt`` to ``format`` and save it to ``output``.

    The destination is checked first (:func:`mmssl.export.paths.check_output`), the checkpoint
    read once, its kind checked against the format, and only then anything written, through a
    temporary file or folder beside ``output``: a refused or failed export leaves it as it was.

    Args:
        ckpt: Lightning checkpoint path.
        format: a key of :data:`EXPORTERS` or :data:`FOLDER_EXPORTERS`.
        output: destination; a state-dict format writes ``.safetensors`` for that suffix, else
            ``torch.save``; a folder format writes the folder ``output`` (``timm``: a folder
            when ``output`` has none of :data:`FILE_SUFFIXES` or is a folder already).
        overwrite: replace an existing file, or a folder of an earlier export.
        ema: export the checkpoint's EMA of the weights (``mmssl.callbacks.EMA``) instead of
            its raw weights; a checkpoint without one is refused, naming the file.

    Returns:
        The exported state dict.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose from {FORMATS}")
    if not checkpoint_exists(ckpt):
        raise FileNotFoundError(f"--ckpt: no checkpoint file at {ckpt!r}")
    folder = format in FOLDER_EXPORTERS and (
        format not in EXPORTERS or os.path.isdir(output) or not output.endswith(FILE_SUFFIXES))
    if folder and output.endswith(FILE_SUFFIXES) and not os.path.isdir(output):
        raise ValueError(f"--format {format} writes a folder: --output {output!r} names a file")
    check_output(output, folder, overwrite)
    checkpoint = read_lightning(ckpt, ema)  # once, weights only; raw or averaged
    try:
        kind = checkpoint_kind(ckpt, checkpoint)
    except ValueError:
        if folder:
            raise
        kind = None  # no kind of the table: the file format's converter names what it lacks
    if kind is not None:
        check_format(kind, format)
        checkpoint = merged_checkpoint(ckpt, checkpoint, kind)  # LoRA adapters folded into the weights
    if folder:
        module = build_module(ckpt, checkpoint, kind)
        return write_folder(output, lambda tmp: FOLDER_EXPORTERS[format](module, tmp, ckpt))
    from_module = MODULE_FILE_EXPORTERS.get((format, kind.name)) if kind is not None else None
    if from_module is not None:
        state = from_module(build_module(ckpt, checkpoint, kind))
    else:
        state = EXPORTERS[format](checkpoint["state_dict"])
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    save_state_file(state, output)
    return state


__all__ = ["EXPORTERS", "FILE_SUFFIXES", "FOLDER_EXPORTERS", "FORMATS", "MODULE_FILE_EXPORTERS", "check_format",
           "export_checkpoint", "to_open_clip", "to_timm"]
