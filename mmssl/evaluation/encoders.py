"""Load anything users want to probe: our Lightning checkpoints, timm and open_clip state dicts.

Every loader returns a module with the probe protocol (``mmssl.evaluation.features``) and
``image_size`` / ``image_mean`` / ``image_std`` for the eval transform; CLIP-like ones also have
``encode_text`` and ``tokenizer`` for zero-shot. Lightning checkpoints are built as one of the kinds
of the one table (:mod:`mmssl.checkpoints.load`): ``MAE``, ``CLIP``, and the fine-tuned
``ImageClassifier`` (its ViT without the head: ``encode_image`` is the pooled pre-logits feature).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import open_clip
import timm
from torch import Tensor, nn

from mmssl.checkpoints import read_state_dict
from mmssl.checkpoints.load import load_lightning, model_class_names
from mmssl.models.classifier import vit_block_features, vit_probe_tokens

__all__ = ["TimmEncoder", "add_checkpoint_arguments", "add_ema_argument", "is_open_clip_name", "load_lightning", "load_model",
           "load_state_dict_model", "model_class_names"]


class TimmEncoder(nn.Module):
    """A timm ViT (``num_classes=0``) behind the probe protocol.

    Args:
        model: the timm model; its pooled output (``global_pool``) is the ``embedding`` feature.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        config = timm.data.resolve_data_config(model=model)
        size = getattr(getattr(model, "patch_embed", None), "img_size", None) or config["input_size"][1:]
        self.image_size = int(size[0])
        self.image_mean, self.image_std = tuple(config["mean"]), tuple(config["std"])
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


def add_checkpoint_arguments(parser: argparse.ArgumentParser, state_dict_models: str = "timm name, open_clip name or .json",
                             model_kwargs: bool = True) -> None:
    """The tools' checkpoint arguments: ``--ckpt``, ``--model``, ``--model-kwargs``, ``--model-class``
    and ``--ema`` (the arguments of :func:`load_model`).

    Args:
        parser: the tool's parser.
        state_dict_models: what ``--model`` may name, for its help.
        model_kwargs: add ``--model-kwargs`` (timm models only).
    """
    parser.add_argument("--ckpt", required=True, help="Lightning .ckpt, or a state dict with --model")
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
        from mmssl.models.clip import CLIP  # evaluation -> models: callbacks never import this

        module: nn.Module = CLIP(model_name=model)
        module.model.load_state_dict(state_dict)
        return module.eval()
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
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ckpt: no file at {path!r}")
    if model:
        if ema:
            raise ValueError(f"--ema reads a Lightning checkpoint's averaged weights; {path} is loaded as a state "
                             f"dict (--model {model}), which holds one set of weights")
        return load_state_dict_model(path, model, model_kwargs)
    return load_lightning(path, model_class, ema)
