"""Masked-image reconstruction on a contrastive model's image tower (MAE, He et al. 2022): the tower
sees a random quarter of the image's patches, a light decoder predicts the pixels of the others,
and the loss is their mean squared error, counted on the masked patches only.

What MAE trains alone (:class:`mmssl.models.MAE`), composed here with CLIP's other terms by name:
``objectives: {contrastive: {}, masked_image: {}}`` on a CLIP config is CLIP with MAE's term on its
image tower (``configs/demo/clip_mae.yaml``), with no class of its own. Its values are MAE's
(sec. 3-4 and the released ``models_mae.py``): 75% of the patches masked per image by MAE's rule
(the smallest of a per-patch uniform kept: :func:`mmssl.models.masking.random_masking`), the tower
running on the visible patches only (with its class token), its final norm on every token, MAE's
decoder (:class:`mmssl.models.mae.MAEDecoder`: a linear embedding, mask tokens, fixed 2-D sin-cos
positions, 8 blocks of width 512 and 16 heads, a linear pixel head), targets normalised per patch
(``norm_pix_loss``, the released models' setting).

The tower's pass over the visible patches is a second pass beside the contrastive one (the
contrastive features see the whole image, as CLIP's do; FLIP instead drops the patches of the
contrastive pass itself, which this term refuses so that one image has one mask). The patches are
dropped at the input of the tower's ``ln_pre``, after the position embedding, as MAE drops them
after its own. The mask's uniforms are the host's per-sample draws (:meth:`Objective.draws`): N
ranks mask what one process masks, a resume masks again what it masked, and a validation sample is
masked alike whichever rank or batch it lands in. The term is the mean over every masked patch of
the global batch, so ranks of unequal batches train what one process trains.

The decoder is the objective's head (its parameters under ``objectives.masked_image.decoder``),
built from the tower's width and patch grid; the model's part registry builds it
(:func:`mmssl.objectives.base.build_part`), since the models sit above the objectives.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.errors import ConfigError
from mmssl.losses import mae_patch_losses
from mmssl.objectives.base import RowsObjective, build_part, image_width, register


@register
class MaskedImageModelling(RowsObjective):
    """MAE's masked-image reconstruction on the image tower (see the module docstring).

    Args:
        weight: the term's weight in the sum.
        start: see :class:`~mmssl.objectives.base.Objective`.
        mask_ratio: share of each image's patches masked (MAE: 0.75).
        norm_pix_loss: per-patch normalised pixel targets (MAE's released models: True).
        decoder_embed_dim: the decoder's width (MAE: 512).
        decoder_depth: its blocks (MAE: 8).
        decoder_num_heads: its heads (MAE: 16).
    """

    name = "masked_image"
    order = 60  # after every other objective's draws in each sample's stream
    host_parts = ("masked_reconstruction",)  # the host's pass of its image tower over the visible patches
    inputs = ("mae_noise",)
    chunked = False  # reads the whole batch's masked pass at once (no GradCache)

    def __init__(self, weight: float = 1.0, start: Union[int, float] = 0, mask_ratio: float = 0.75,
                 norm_pix_loss: bool = True, decoder_embed_dim: int = 512, decoder_depth: int = 8,
                 decoder_num_heads: int = 16) -> None:
        super().__init__(weight, start)
        key = f"model.init_args.objectives.{self.name}"
        if isinstance(mask_ratio, bool) or not isinstance(mask_ratio, (int, float)) or not 0.0 < mask_ratio < 1.0:
            raise ConfigError(f"{key}.mask_ratio: in (0, 1), got {mask_ratio!r}")
        for option, value in (("decoder_embed_dim", decoder_embed_dim), ("decoder_depth", decoder_depth),
                              ("decoder_num_heads", decoder_num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}.{option}: an integer >= 1, got {value!r}")
        if decoder_embed_dim % decoder_num_heads:
            raise ConfigError(f"{key}.decoder_embed_dim: {decoder_embed_dim} is not divisible by "
                              f"decoder_num_heads={decoder_num_heads}")
        self.mask_ratio = float(mask_ratio)
        self.norm_pix_loss = bool(norm_pix_loss)
        self.decoder_sizes = {"embed_dim": decoder_embed_dim, "depth": decoder_depth, "num_heads": decoder_num_heads}
        self.decoder: Optional[nn.Module] = None  # built in bind, read by the host's masked pass
        self.patches = 0
        self.val_loss = MeanMetric()

    def bind(self, model: nn.Module) -> None:
        key = f"model.init_args.objectives.{self.name}"
        width = image_width(model, self.name, "tokens")
        patch = tuple(getattr(model.visual, "patch_size", ()))
        self.patches = int(model.visual.positional_embedding.shape[0]) - 1  # L: the grid, without cls
        grid = round(self.patches ** 0.5)
        if len(patch) != 2 or patch[0] != patch[1] or grid * grid != self.patches:
            raise ConfigError(f"{key}: needs square patches on a square grid, got patch_size {patch} and "
                              f"{self.patches} patches")
        self.decoder = build_part("mae_decoder", key, num_patches=self.patches, patch_size=int(patch[0]),
                                  encoder_dim=width, **self.decoder_sizes)

    def check(self, host: nn.Module, model_name: str) -> None:
        if getattr(host, "image_mask_ratio", 0.0):
            raise ConfigError(f"model.init_args.objectives.{self.name}: FLIP drops image patches of the contrastive "
                              f"pass (model.init_args.flip.mask_ratio={host.image_mask_ratio}) and this term masks "
                              "its own: set flip.mask_ratio: 0")

    def draws(self, batch: Mapping[str, Tensor], training: bool) -> int:
        return self.patches  # one uniform per patch: its rank in the mask

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        return {"mae_noise": uniforms}

    def rows(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """(M,) the squared error of every masked patch, row-major over (B, L)."""
        losses = mae_patch_losses(out["mae_target"], out["mae_pred"], self.norm_pix_loss)  # (B, L)
        return losses[out["mae_mask"].bool()]

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        return self.global_mean(self.rows(out, batch), weight)  # the global batch's masked-patch mean
