"""Load anything users want to probe: our Lightning checkpoints, timm and open_clip state dicts.

Every loader returns a module with the probe protocol (``mmssl.evaluation.features``) and
``image_size`` / ``image_mean`` / ``image_std`` for the eval transform; CLIP-like ones also have
``encode_text`` and ``tokenizer`` for zero-shot.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

import lightning.pytorch as pl
import open_clip
import timm
import torch
import yaml
from torch import Tensor, nn


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
        tokens = self.model.forward_features(images)  # (B, prefix+L, D)
        return torch.cat([tokens[:, :1], tokens[:, self.num_prefix_tokens :]], dim=1)

    def forward_intermediates(self, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
        """Pooled (B, D) output of every block, block 1 first (timm's ``forward_intermediates``)."""
        out = self.model.forward_intermediates(
            images, norm=norm, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
        )  # [((B, L, D) patches, (B, prefix, D) prefix)] per block
        return [prefix[:, 0] if pool == "cls" else patches.mean(dim=1) for patches, prefix in out]


def _strip_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Unwrap ``{"state_dict": ...}`` / ``{"model": ...}`` and DDP's ``module.`` key prefix."""
    for key in ("state_dict", "model"):
        if isinstance(state_dict.get(key), dict):
            state_dict = state_dict[key]
    if state_dict and all(k.startswith("module.") for k in state_dict):
        state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
    return state_dict


def _lightning_class(path: str, checkpoint: dict) -> type:
    """The LightningModule class of a checkpoint: its ``_class_path`` hyper-parameter (written by
    LightningCLI), else ``model.class_path`` of the run's ``config.yaml`` (``run/checkpoints/x.ckpt``)."""
    class_path = checkpoint.get("hyper_parameters", {}).get("_class_path")
    if class_path is None:
        config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")
        if os.path.isfile(config):
            with open(config) as f:
                class_path = (yaml.safe_load(f).get("model") or {}).get("class_path")
    if not class_path:
        raise ValueError(
            f"{path}: the checkpoint names no model class (no hyper_parameters._class_path, no "
            "config.yaml beside the run): pass --model-class, e.g. mmssl.models.clip.CLIP"
        )
    module_name, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


def load_lightning(path: str, model_class: Optional[str] = None) -> pl.LightningModule:
    """Load an mmssl Lightning checkpoint with the LightningModule class recorded in it.

    Args:
        path: the ``.ckpt`` file.
        model_class: dotted class path overriding what the checkpoint records.

    Returns:
        The module on the CPU, in eval mode.
    """
    if model_class:
        module_name, _, name = model_class.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
    else:
        cls = _lightning_class(path, torch.load(path, map_location="cpu", weights_only=False))
    return cls.load_from_checkpoint(path, map_location="cpu", weights_only=False).eval()


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
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state_dict = load_file(path)
    else:
        state_dict = _strip_prefix(torch.load(path, map_location="cpu", weights_only=True))
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
    path: str, model: Optional[str] = None, model_kwargs: Optional[dict] = None, model_class: Optional[str] = None
) -> nn.Module:
    """Load a Lightning checkpoint, or a state dict when ``model`` names its architecture.

    Args:
        path: checkpoint or state-dict file.
        model: architecture of a state-dict file (open_clip name / JSON, or timm name).
        model_kwargs: ``timm.create_model`` extras.
        model_class: LightningModule class path for checkpoints that record none.

    Returns:
        The module with the probe protocol, in eval mode, on the CPU.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ckpt: no file at {path!r}")
    if model:
        return load_state_dict_model(path, model, model_kwargs)
    return load_lightning(path, model_class)
