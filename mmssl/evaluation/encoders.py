"""Load anything users want to probe: our Lightning checkpoints, timm and open_clip state dicts, and
the export folders (open_clip hub, timm hub, transformers ``CLIPModel``).

Every loader returns a module with the probe protocol (``mmssl.evaluation.features``) and
``image_size`` / ``image_mean`` / ``image_std`` for the eval transform; CLIP-like ones also have
``encode_text`` and ``tokenizer`` for zero-shot. Lightning checkpoints are built as one of the kinds
of the one table (:mod:`mmssl.checkpoints.load`): ``MAE``, ``CLIP``, and the fine-tuned
``ImageClassifier`` (its ViT without the head: ``encode_image`` is the pooled pre-logits feature).
Export folders (:func:`load_encoder`) are built by :func:`mmssl.checkpoints.folders.build_folder`,
the builder the distillation teacher shares, and wrapped here.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Optional

import open_clip
import timm
import torch.nn.functional as F
from torch import Tensor, nn

from mmssl.checkpoints import read_state_dict
from mmssl.checkpoints.folders import (
    HF,
    OPEN_CLIP_HF,
    TIMM,
    FolderModel,
    build_folder,
    folder_format,
    hf_projected,
    open_clip_image_settings,
    timm_image_settings,
)
from mmssl.checkpoints.load import load_lightning, model_class_names, open_clip_module
from mmssl.checkpoints.read import checkpoint_exists
from mmssl.models.classifier import vit_block_features, vit_probe_tokens

__all__ = ["HFClipEncoder", "OpenClipEncoder", "TimmEncoder", "add_checkpoint_arguments", "add_ema_argument",
           "export_format", "load_encoder", "is_open_clip_name", "load_lightning", "load_model",
           "load_state_dict_model", "model_class_names"]


class TimmEncoder(nn.Module):
    """A timm ViT (``num_classes=0``) behind the probe protocol.

    Args:
        model: the timm model; its pooled output (``global_pool``) is the ``embedding`` feature.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.image_size, self.image_mean, self.image_std = timm_image_settings(model)
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))

    def encode_image(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, D): the model's pooled features (head removed)."""
        return self.model(images)

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, 1+L, D): cls token then patch tokens (register tokens dropped)."""
        return vit_probe_tokens(self.model, images)

    def forward_intermediates(self, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
        """Pooled (B, D) output of every block, block 1 first (timm's ``forward_intermediates``)."""
        return vit_block_features(self.model, images, pool, norm)


def add_checkpoint_arguments(parser: argparse.ArgumentParser,
                             state_dict_models: str = "timm name, open_clip name or .json",
                             model_kwargs: bool = True, ckpt_required: bool = True) -> None:
    """The tools' checkpoint arguments: ``--ckpt``, ``--model``, ``--model-kwargs``, ``--model-class``
    and ``--ema`` (the arguments of :func:`load_model`).

    Args:
        parser: the tool's parser.
        state_dict_models: what ``--model`` may name, for its help.
        model_kwargs: add ``--model-kwargs`` (timm models only).
        ckpt_required: ``--ckpt`` must be given (a tool with another way in says so itself).
    """
    parser.add_argument("--ckpt", required=ckpt_required,
                        help="Lightning .ckpt (or a sharded checkpoint folder), a state dict with --model, "
                        "or an export folder")
    parser.add_argument("--model", help=f"architecture of a state-dict file: {state_dict_models}")
    if model_kwargs:
        parser.add_argument("--model-kwargs", type=json.loads, default=None, help="JSON dict for timm.create_model")
    parser.add_argument("--model-class", choices=model_class_names(),
                        help="model class if the checkpoint records none (only mmssl's own are built)")
    add_ema_argument(parser)


def add_ema_argument(parser: argparse.ArgumentParser) -> None:
    """``--ema``: a Lightning checkpoint's averaged weights (``mmssl.callbacks.EMA``) instead of its raw ones.

    Args:
        parser: the tool's parser.
    """
    parser.add_argument("--ema", action="store_true",
                        help="use the checkpoint's EMA of the weights (trained with mmssl.callbacks.EMA; a "
                             "checkpoint without one is refused); default: the raw weights")


def is_open_clip_name(name: str) -> bool:
    """True for an open_clip model config name or a ``.json`` config path."""
    return name.endswith(".json") or name in open_clip.list_models()


def load_state_dict_model(path: str, model: str, model_kwargs: Optional[dict] = None) -> nn.Module:
    """Build ``model`` and load an exported state-dict file into it (strict: every key must match).

    Args:
        path: the state-dict file (``.pt`` / ``.pth`` / ``.bin``; ``.safetensors`` too).
        model: an open_clip name / JSON config (-> our ``CLIP`` module around the open_clip model)
            or a timm name such as ``vit_base_patch16_224`` (-> ``TimmEncoder``).
        model_kwargs: extra ``timm.create_model`` arguments (e.g. ``{"img_size": 32}``).

    Returns:
        The module with the probe protocol, in eval mode.
    """
    state_dict = read_state_dict(path)
    if is_open_clip_name(model):
        return open_clip_module(path, model, state_dict)
    if model not in timm.list_models():
        raise ValueError(f"--model {model!r} is neither an open_clip model / .json config nor a timm model name")
    kwargs = {"pretrained": False, "num_classes": 0, **(model_kwargs or {})}
    encoder = timm.create_model(model, **kwargs)
    encoder.load_state_dict(state_dict)
    return TimmEncoder(encoder).eval()


def load_model(
    path: str, model: Optional[str] = None, model_kwargs: Optional[dict] = None, model_class: Optional[str] = None,
    ema: bool = False,
) -> nn.Module:
    """Load a Lightning checkpoint, or a state dict when ``model`` names its architecture.

    Args:
        path: checkpoint or state-dict file.
        model: architecture of a state-dict file (open_clip name / JSON, or timm name).
        model_kwargs: ``timm.create_model`` extras.
        model_class: ``MAE`` / ``CLIP`` / ``ImageClassifier`` (or their class paths) for
            checkpoints that record none.
        ema: a Lightning checkpoint's averaged weights (refused for a state dict, or a
            checkpoint trained without ``mmssl.callbacks.EMA``).

    Returns:
        The module with the probe protocol, in eval mode, on the CPU.
    """
    if os.path.isdir(path) and not checkpoint_exists(path):
        kind = export_format(path)  # a folder of no known kind is refused there, its files named
        raise ValueError(f"--ckpt {path!r} is a{'n' if kind[0] in 'aeiou' else ''} {kind} export folder, which holds "
                         "the encoder alone: this tool reads the Lightning checkpoint (.ckpt) it was exported from")
    if not checkpoint_exists(path):
        raise FileNotFoundError(f"--ckpt: no file at {path!r}")
    problem = not_a_checkpoint(path)
    if problem:
        raise ValueError(f"--ckpt {path!r} is not a checkpoint: {problem}")
    if model:
        if ema:
            raise ValueError(f"--ema reads a Lightning checkpoint's averaged weights; {path} is loaded as a state "
                             f"dict (--model {model}), which holds one set of weights")
        return load_state_dict_model(path, model, model_kwargs)
    return load_lightning(path, model_class, ema)


# The first bytes of what torch.load and safetensors read: a zip archive (torch.save's format), a
# pickle (torch.save's legacy format, protocol 2+), a safetensors header (a little-endian length, then JSON).
_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"


def not_a_checkpoint(path: str) -> Optional[str]:
    """Why the file at ``path`` is no checkpoint or state dict, read from its first bytes (a JSON model
    config, a YAML recipe, an image, given as ``--ckpt``); ``None`` for what may be one."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        head = f.read(9)
    if not head:
        return "the file is empty"
    if head.startswith((_ZIP, _PICKLE)):
        return None
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path):
        return None  # safetensors
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        return "it is a JSON file (a model config is --model's, or a recipe's model_name)"
    return f"it starts with {head[:8]!r}, where a torch.save file or a .safetensors file starts otherwise"


class OpenClipEncoder(nn.Module):
    """An open_clip model from a hub folder (``--format open_clip_hf``) behind the probe protocol.

    Args:
        model: the open_clip ``CLIP``, weights loaded.
        tokenizer: open_clip's tokenizer for its config.
    """

    def __init__(self, model: nn.Module, tokenizer) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.image_size, self.image_mean, self.image_std = open_clip_image_settings(model)

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """(B, 3, H, W) -> (B, D) image embeddings."""
        return self.model.encode_image(images, normalize=normalize)

    def encode_text(self, tokens: Tensor, normalize: bool = True) -> Tensor:
        """(B, L) token ids -> (B, D) text embeddings."""
        return self.model.encode_text(tokens, normalize=normalize)


class HFClipEncoder(nn.Module):
    """A transformers ``CLIPModel`` folder (``--format hf``) behind the probe protocol.

    Args:
        model: the ``CLIPModel``, weights loaded.
        tokenizer: texts -> (B, L) token ids, padded and truncated to the model's context length.
        image_size, image_mean, image_std: the model's input size and ``preprocessor_config.json``'s normalisation.
    """

    def __init__(self, model: nn.Module, tokenizer: Callable, image_size: int, image_mean: tuple,
                 image_std: tuple) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.context_length = int(model.config.text_config.max_position_embeddings)
        self.image_size, self.image_mean, self.image_std = image_size, tuple(image_mean), tuple(image_std)

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """(B, 3, H, W) -> (B, D) projected image embeddings."""
        out = hf_projected(self.model.get_image_features(pixel_values=images))
        return F.normalize(out, dim=-1) if normalize else out

    def encode_text(self, tokens: Tensor, normalize: bool = True) -> Tensor:
        """(B, L) token ids -> (B, D) projected text embeddings."""
        out = hf_projected(self.model.get_text_features(input_ids=tokens))
        return F.normalize(out, dim=-1) if normalize else out


def export_format(path: str) -> Optional[str]:
    """Which export folder ``path`` is: ``"open_clip_hf"``, ``"timm"``, ``"hf"``, or ``None`` (a file
    or a sharded checkpoint folder): :func:`mmssl.checkpoints.folders.folder_format`.

    Raises:
        ValueError: a folder that is none of them (its files named).
    """
    return folder_format(path)


def folder_encoder(folder: FolderModel) -> nn.Module:
    """An export folder's model (:func:`mmssl.checkpoints.folders.build_folder`) behind the probe protocol."""
    if folder.format == OPEN_CLIP_HF:
        return OpenClipEncoder(folder.model, folder.tokenizer).eval()
    if folder.format == HF:
        return HFClipEncoder(folder.model, folder.tokenizer, folder.image_size, folder.image_mean,
                             folder.image_std).eval()
    assert folder.format == TIMM, folder.format
    return TimmEncoder(folder.model).eval()


def load_encoder(path: str, model: Optional[str] = None, model_kwargs: Optional[dict] = None,
                 model_class: Optional[str] = None, ema: bool = False) -> nn.Module:
    """Any checkpoint or export: a folder by its config (:func:`export_format`), else :func:`load_model`.

    Args:
        path: a Lightning ``.ckpt``, a state-dict file (with ``model``), or an export folder.
        model, model_kwargs, model_class, ema: see :func:`load_model` (files only: ``ema`` is refused
            for a folder).

    Returns:
        The module with the probe protocol, in eval mode, on the CPU.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"--ckpt: nothing at {path!r}")
    kind = export_format(path)
    if kind and ema:
        raise ValueError(f"{path}: --ema reads a Lightning checkpoint's averaged weights; this {kind} export folder "
                         "holds one set of weights (export the average with tools/export.py --ema)")
    if kind:
        return folder_encoder(build_folder(path, format=kind))
    return load_model(path, model, model_kwargs, model_class, ema)
