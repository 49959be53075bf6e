"""FLIP (Li et al. 2023): drop a random fraction of image patches so the image tower runs on fewer.

open_clip's ``VisionTransformer._embeds`` calls ``self.patch_dropout(x)`` right after the patch and
position embeddings (and timm's ``VisionTransformer`` calls ``self.patch_drop(x)`` at the same
point), so FLIP masking is a drop-in replacement for that module. It draws the kept patches with
MAE's per-sample ``random_masking`` (``mmssl.models.masking``), the code MAE's encoder uses, and
keeps the prefix (cls / register) tokens. Like open_clip's ``PatchDropout`` it is active only in
training mode: evaluation and zero-shot see every patch (FLIP sec. 3, "unmasked at inference").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from mmssl.models.masking import gather_tokens, random_masking
from mmssl.optim import Phase


@dataclass(frozen=True)
class Flip:
    """``model.init_args.flip``: FLIP's patch masking and its unmasked tuning (Li et al. 2023).

    Attributes:
        mask_ratio: fraction of image patches dropped in training (0.5 in the paper); ``None``
            keeps the model config's ``patch_dropout`` (0 when unset).
        unmasked_tune_steps: FLIP sec. 3 "unmasked tuning": the last this many optimizer steps of
            the run (``trainer.max_steps`` includes them) train on whole images, closing the
            masked/unmasked distribution gap. They are a phase of their own, as in the FLIP README:
            the masked schedule's cosine ends where they start, then a new warm-up and cosine to 0
            at ``unmasked_tune_lr_ratio`` x the masked phase's peak LR.
        unmasked_tune_lr_ratio: peak LR of the tuning phase over the masked phase's (FLIP README:
            base lr 4e-8 vs 4e-6 per 256 samples, so 0.01 at any batch size).
        unmasked_tune_warmup_steps: linear warm-up steps of the tuning phase.
    """

    mask_ratio: Optional[float] = None
    unmasked_tune_steps: int = 0
    unmasked_tune_lr_ratio: float = 0.01
    unmasked_tune_warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.unmasked_tune_steps < 0 or self.unmasked_tune_warmup_steps < 0 or self.unmasked_tune_lr_ratio < 0:
            raise ValueError(
                "model.flip.unmasked_tune_steps, unmasked_tune_warmup_steps and unmasked_tune_lr_ratio must be "
                f">= 0, got {self.unmasked_tune_steps}, {self.unmasked_tune_warmup_steps}, "
                f"{self.unmasked_tune_lr_ratio}")

    def tuning_phase(self) -> Optional[Phase]:
        """The unmasked-tuning phase of the LR schedule (:func:`mmssl.optim.warmup_cosine`), if any."""
        if not self.unmasked_tune_steps:
            return None
        return Phase(self.unmasked_tune_steps, self.unmasked_tune_warmup_steps, self.unmasked_tune_lr_ratio)

    def ratio_at(self, step: int, total: int, ratio: float) -> float:
        """The mask ratio at optimizer step ``step`` of ``total``: 0 in the final unmasked tuning."""
        return 0.0 if self.unmasked_tune_steps and step >= total - self.unmasked_tune_steps else ratio


# The flat keys of configs and checkpoints written before FLIP became a config group.
FLIP_RENAMES = {"image_mask_ratio": "flip.mask_ratio", "unmasked_tune_steps": "flip.unmasked_tune_steps",
                "unmasked_tune_lr_ratio": "flip.unmasked_tune_lr_ratio",
                "unmasked_tune_warmup_steps": "flip.unmasked_tune_warmup_steps"}


class FlipMasking(nn.Module):
    """Keep a random ``1 - ratio`` of the patch tokens of each image during training.

    Args:
        ratio: fraction of patches removed, in [0, 1); 0 disables masking.
        num_prefix_tokens: leading tokens always kept (1 for the cls token).
    """

    def __init__(self, ratio: float = 0.0, num_prefix_tokens: int = 1) -> None:
        super().__init__()
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"model.flip.mask_ratio must be in [0, 1), got {ratio}")
        self.ratio = ratio
        self.num_prefix_tokens = num_prefix_tokens

    def forward(self, x: Tensor) -> Tensor:
        """(B, P + L, D) tokens -> (B, P + L_keep, D); unchanged in eval mode or at ratio 0."""
        if not self.training or self.ratio == 0.0:
            return x
        prefix, patches = x[:, : self.num_prefix_tokens], x[:, self.num_prefix_tokens :]
        masking = random_masking(patches, self.ratio)  # ids_keep: (B, L_keep)
        kept = gather_tokens(patches, masking.ids_keep)  # (B, L_keep, D)
        return torch.cat([prefix, kept], dim=1)

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, num_prefix_tokens={self.num_prefix_tokens}"


def install_flip_masking(visual: nn.Module, ratio: float) -> FlipMasking:
    """Put a :class:`FlipMasking` where the image tower drops patches; returns it.

    Args:
        visual: an open_clip image tower: ``VisionTransformer`` (``patch_dropout`` hook) or
            ``TimmModel`` over a timm ViT (``trunk.patch_drop`` hook).
        ratio: fraction of patches removed in training.

    Returns:
        The installed module; set its ``ratio`` to change masking (0 for unmasked tuning).
    """
    if hasattr(visual, "patch_dropout"):  # open_clip VisionTransformer: cls token first
        masking = FlipMasking(ratio, num_prefix_tokens=1)
        visual.patch_dropout = masking
        return masking
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and hasattr(trunk, "patch_drop"):  # timm VisionTransformer
        masking = FlipMasking(ratio, num_prefix_tokens=int(getattr(trunk, "num_prefix_tokens", 1)))
        trunk.patch_drop = masking
        return masking
    if ratio > 0:
        raise ValueError(
            f"model.flip.mask_ratio={ratio}: the image tower {type(visual).__name__} has no "
            "patch-dropout hook (FLIP needs a ViT: open_clip VisionTransformer or a timm ViT)"
        )
    return FlipMasking(0.0)
