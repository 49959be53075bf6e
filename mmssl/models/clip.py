"""CLIP LightningModule over open_clip towers (Radford et al. 2021).

open_clip builds the towers, the tokenizer and the preprocessing config, so any model config name
it knows (``open_clip.list_models()``) or a JSON config file of ours works unchanged.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import open_clip
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from mmssl.losses import clip_loss
from mmssl.optim import param_groups, warmup_cosine


def resolve_model_name(model_name: str) -> str:
    """Register a JSON model config with open_clip if given a path; return the open_clip name.

    Args:
        model_name: an open_clip model name (``ViT-B-32``) or a path to a ``.json`` config.

    Returns:
        The name open_clip knows the config by (the file's stem for a JSON path).
    """
    if model_name.endswith(".json"):
        if not os.path.isfile(model_name):
            raise FileNotFoundError(f"model.model_name: no model config file at {model_name!r}")
        open_clip.add_model_config(model_name)
        return os.path.splitext(os.path.basename(model_name))[0]
    if model_name not in open_clip.list_models():
        raise ValueError(
            f"model.model_name: {model_name!r} is neither an open_clip model "
            "(see open_clip.list_models()) nor a path to a .json model config"
        )
    return model_name


class CLIP(pl.LightningModule):
    """Contrastive image-text pretraining.

    Args:
        model_name: open_clip model config name, or path to a JSON config file.
        optimizer: optimizer factory over parameter groups (no weight decay on biases, norms,
            embeddings and ``logit_scale``); AdamW by default.
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: final LR of the cosine as a fraction of the peak.
        logit_scale_max: clamp of the learned logit scale (CLIP: 100).
    """

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        warmup_steps: int = 2000,
        min_lr_ratio: float = 0.0,
        logit_scale_max: float = 100.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        name = resolve_model_name(model_name)
        # Random init, logit_scale = log(1/0.07) as in CLIP; nothing is downloaded.
        self.model = open_clip.create_model(name, pretrained=None, output_dict=True)
        self.tokenizer: Callable = open_clip.get_tokenizer(name)
        size = self.model.visual.image_size
        self.image_size: int = size[0] if isinstance(size, (tuple, list)) else int(size)
        self.image_mean: tuple[float, ...] = tuple(self.model.visual.image_mean)
        self.image_std: tuple[float, ...] = tuple(self.model.visual.image_std)
        self.optimizer = optimizer
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.logit_scale_max = logit_scale_max

    # Named stages, what callbacks and exports call ------------------------------------------------

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """(B, 3, H, W) images -> (B, D) embeddings."""
        return self.model.encode_image(images, normalize=normalize)

    def encode_text(self, tokens: Tensor, normalize: bool = True) -> Tensor:
        """(B, L) token ids -> (B, D) embeddings."""
        return self.model.encode_text(tokens, normalize=normalize)

    # Probe hooks (added by the evaluation branch, issue 6): the protocol of
    # mmssl.evaluation.features, over open_clip's VisionTransformer.forward_intermediates.

    def forward_features(self, images: Tensor) -> Tensor:
        """Image-tower tokens after the final norm (``ln_post``): (B, 3, H, W) -> (B, 1+L, D)."""
        return self._visual_intermediates(images, indices=1, norm=True)[-1]  # indices=1: last block

    def forward_intermediates(self, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
        """Pooled (B, D) output of every image-tower block, block 1 first (``pool``: cls / avg)."""
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', got {pool!r}")
        tokens = self._visual_intermediates(images, norm=norm)
        return [t[:, 0] if pool == "cls" else t[:, 1:].mean(dim=1) for t in tokens]

    def _visual_intermediates(self, images: Tensor, indices=None, norm: bool = False) -> list[Tensor]:
        visual = self.model.visual
        if not hasattr(visual, "forward_intermediates"):
            raise TypeError(f"image tower {type(visual).__name__} has no forward_intermediates (needs a ViT)")
        out = visual.forward_intermediates(
            images, indices=indices, normalize_intermediates=norm, intermediates_only=True,
            output_fmt="NLC", output_extra_tokens=True,
        )
        # open_clip returns the cls token and the patch tokens apart: (B, 1, D) + (B, L, D).
        return [torch.cat([cls, patches], dim=1) for cls, patches in
                zip(out["image_intermediates_prefix"], out["image_intermediates"])]

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """Returns ``image_features`` (B, D), ``text_features`` (B, D), ``logit_scale`` ()."""
        return self.model(images, tokens)

    # Training ----------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        out = self(batch["image"], batch["text"])
        return clip_loss(out["image_features"], out["text_features"], out["logit_scale"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/logit_scale", self.model.logit_scale.exp().detach())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True, batch_size=batch["image"].shape[0])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # CLIP sec. 2.5: the temperature is clipped so logits are scaled by at most 100.
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(self.logit_scale_max))

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer(param_groups(self))
        total = self.trainer.estimated_stepping_batches
        scheduler = warmup_cosine(optimizer, self.warmup_steps, total, self.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
