"""Masked autoencoder (He et al. 2021): light decoder and the ``MAE`` LightningModule.

Follows facebookresearch/mae ``models_mae.py`` (``forward_decoder``, ``forward_loss``) and
``main_pretrain.py`` (base-LR scaling, AdamW betas (0.9, 0.95), per-step warm-up + cosine).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from timm.models.vision_transformer import Block
from torch import nn
from torchmetrics import MeanMetric

from mmssl.checkpoints.read import checkpoint_exists, read_state_dict
from mmssl.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from mmssl.distributed import seed_per_rank
from mmssl.log_cadence import logging_step
from mmssl.losses import mae_loss
from mmssl.models.masking import Masking, patchify, sample_noise, unpatchify
from mmssl.models.memory import compile_blocks, compile_options, run_blocks
from mmssl.models.vit import LayerNorm, MaskedViT, init_vit_weights, load_encoder, sincos_pos_embed_2d
from mmssl.objectives.base import register_part
from mmssl.optim import (
    NDIM_LT_2,
    build_optimizer,
    check_layer_decay,
    check_warmup,
    layer_scales,
    lr_from_blr,
    record_shapes,
    unmatched_patterns,
    warmup_cosine,
)
from mmssl.sharding import shard_model
from mmssl.upstream import attached_trainer

# timm 0.3.2 add_weight_decay, as main_pretrain.py calls it: len(shape) == 1 or name.endswith(".bias").
MAE_NO_DECAY: tuple[str, ...] = (NDIM_LT_2, "*.bias")
# The one tower layer decay applies to (the decoder is discarded after pretraining: it keeps 1).
MAE_TOWERS = {"encoder": ("encoder.*",)}

# facebookresearch/mae models_mae.py names of the decoder's parameters -> MAEDecoder's.
MAE_DECODER_NAMES = {
    "decoder_embed.": "embed.",
    "mask_token": "mask_token",
    "decoder_pos_embed": "pos_embed",
    "decoder_blocks.": "blocks.",
    "decoder_norm.": "norm.",
    "decoder_pred.": "pred.",
}


def mae_adamw(params: Any) -> torch.optim.Optimizer:
    """MAE ``main_pretrain.py`` optimizer: AdamW, betas (0.9, 0.95), weight decay 0.05.

    The LR here is a placeholder: ``MAE(blr=...)`` sets it from the global batch size.
    """
    return torch.optim.AdamW(params, lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.05)


@register_part("mae_decoder")  # built by mmssl.objectives.masked_image on a contrastive model's image tower
class MAEDecoder(nn.Module):
    """MAE's light decoder: mask tokens fill the removed positions, then blocks and a pixel head.

    Args:
        num_patches: L, patches per image.
        patch_size: p.
        encoder_dim: width of the encoder tokens it receives.
        embed_dim: decoder width (paper: 512).
        depth: decoder blocks (paper: 8).
        num_heads: decoder heads (paper: 16).
        mlp_ratio: MLP hidden width / decoder width.
        in_chans: image channels predicted per pixel.
    """

    def __init__(
        self,
        num_patches: int,
        patch_size: int,
        encoder_dim: int,
        embed_dim: int = 512,
        depth: int = 8,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(
                f"decoder_embed_dim ({embed_dim}) must be divisible by "
                f"decoder_num_heads ({num_heads})"
            )
        grid = int(round(num_patches**0.5))
        self.embed = nn.Linear(encoder_dim, embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(
            sincos_pos_embed_2d(embed_dim, grid, cls_token=True).unsqueeze(0), requires_grad=False
        )
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=LayerNorm)
            for _ in range(depth)
        )
        self.norm = LayerNorm(embed_dim)
        self.pred = nn.Linear(embed_dim, patch_size**2 * in_chans)
        self.grad_checkpointing = False  # activation checkpointing of the blocks (mmssl.models.memory)
        nn.init.normal_(self.mask_token, std=0.02)
        self.apply(init_vit_weights)

    def forward(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Predict the pixels of every patch.

        Args:
            x: (B, 1+L_keep, D_enc) encoder tokens, cls first, visible patches in shuffled order.
            ids_restore: (B, L) from the masking, to unshuffle.

        Returns:
            (B, L, p*p*C) predicted pixels in patch order (cls dropped).
        """
        x = self.embed(x)  # (B, 1+L_keep, D)
        batch, length, dim = x.shape[0], ids_restore.shape[1], x.shape[2]
        mask_tokens = self.mask_token.expand(batch, length + 1 - x.shape[1], -1)  # (B, L-L_keep, D)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)  # (B, L, D), shuffled order
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))  # patch order
        x = torch.cat([x[:, :1], x_], dim=1) + self.pos_embed  # (B, 1+L, D)
        x = run_blocks(self.blocks, x, self.grad_checkpointing)
        return self.pred(self.norm(x))[:, 1:]  # (B, L, p*p*C)


def load_decoder(decoder: MAEDecoder, state: dict[str, torch.Tensor]) -> bool:
    """Initialise ``decoder`` from a checkpoint file that holds a decoder of the same shape.

    Reads mmssl checkpoints (``decoder.*``) and MAE's releases with a decoder (the
    ``mae_visualize_*`` files, ``decoder_*`` and ``mask_token``), so pretraining can continue.

    Args:
        decoder: the decoder to fill in place.
        state: the checkpoint file's tensors (:func:`mmssl.checkpoints.read_state_dict`).

    Returns:
        Whether the file held a matching decoder (else ``decoder`` is left as it was).
    """
    found = {}
    for key, value in state.items():
        if key.startswith("decoder."):
            found[key.removeprefix("decoder.")] = value
            continue
        for ours_from, ours_to in MAE_DECODER_NAMES.items():
            if key.startswith(ours_from):
                found[ours_to + key[len(ours_from):]] = value
    own = decoder.state_dict()
    if set(found) != set(own) or any(found[k].shape != own[k].shape for k in own):
        return False
    decoder.load_state_dict(found)
    return True


class MAE(LightningModule):
    """Masked-autoencoder pretraining of a ViT.

    Args:
        image_size: input side in pixels (must be divisible by ``patch_size``).
        patch_size: ViT patch side.
        embed_dim: encoder width.
        depth: encoder blocks.
        num_heads: encoder heads.
        mlp_ratio: encoder MLP ratio.
        decoder_embed_dim: decoder width (paper 512).
        decoder_depth: decoder blocks (paper 8).
        decoder_num_heads: decoder heads (paper 16).
        mask_ratio: fraction of patches removed, in (0, 1) (paper 0.75).
        norm_pix_loss: per-patch normalised pixel targets (paper's released models: True).
        optimizer: optimizer factory over parameter groups; weight decay is set there. A
            Muon-family optimizer (``timm.optim.Muon``) takes the encoder's and decoder's block
            weight matrices, its AdamW fallback the rest (:func:`mmssl.optim.muon_takes`).
        blr: base LR; when set, each group's LR becomes blr x global batch / 256 (MAE sec. A.1).
        warmup_steps: linear warm-up steps (paper: 40 of 800 epochs).
        min_lr_ratio: final LR of the cosine as a fraction of the peak (MAE: 0).
        init_encoder: local timm / MAE-released / mmssl checkpoint file to initialise the
            encoder from; if it also holds a decoder of this shape (MAE's ``mae_visualize_*``
            releases, mmssl checkpoints) that initialises the decoder, to continue pretraining.
            ``MAE.load_from_checkpoint(..., init_encoder=None)`` skips it when the file is gone.
        image_mean: per-channel mean the data is normalised with (linked to the data module).
        image_std: per-channel std, likewise.
        no_weight_decay: parameters not decayed: ``fnmatch`` globs on ``named_parameters()``
            names plus ``"ndim<2"`` (every parameter built with fewer than 2 dims), decided from
            shapes recorded at build time so FSDP's flattening does not change it. Default: the
            official pretraining's rule (``main_pretrain.py`` -> timm 0.3.2 ``add_weight_decay``
            with an empty skip list: 1-D or ``.bias``), so ``cls_token`` and ``mask_token`` are
            decayed; ``pos_embed`` is fixed sin-cos and not trained at all.
        grad_checkpointing: activation checkpointing of the encoder and decoder blocks: less
            activation memory for one more forward of each block; the same gradients.
        compile: ``torch.compile`` the encoder and decoder blocks in place; ``true`` or a dict of
            ``torch.compile`` arguments (``mmssl.models.memory``).
        layer_decay: layer-wise LR decay of the encoder (BEiT numbering, as ``Classifier``): block
            N of ``depth`` D at ``decay ** (D - N)`` x the LR, patch embedding and class token at
            ``decay ** (D + 1)``, the final norm and the whole decoder at 1. ``None``: off.
    """

    tokenizer = None  # images only; the CLI links this into the data module

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = True,
        optimizer: OptimizerCallable = mae_adamw,
        blr: Optional[float] = 1.5e-4,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        init_encoder: Optional[str] = None,
        image_mean: tuple[float, float, float] = IMAGENET_MEAN,
        image_std: tuple[float, float, float] = IMAGENET_STD,
        no_weight_decay: Optional[list[str]] = None,
        grad_checkpointing: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        layer_decay: Optional[float] = None,
    ) -> None:
        super().__init__()
        # Reject a ratio of 0 too: with nothing masked the loss has no targets.
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        check_warmup("model.warmup_steps", warmup_steps)
        decays = check_layer_decay("model.init_args.layer_decay", layer_decay, tuple(MAE_TOWERS))
        self.save_hyperparameters(ignore=["optimizer"])
        self.image_size = image_size
        self.image_mean = tuple(image_mean)
        self.image_std = tuple(image_std)
        self.patch_size = patch_size
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        self.optimizer = optimizer
        self.blr = blr
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.val_loss = MeanMetric()  # sum and count of the validation loss, reduced over ranks
        self.encoder = MaskedViT(image_size, patch_size, 3, embed_dim, depth, num_heads, mlp_ratio)
        self.decoder = MAEDecoder(
            self.encoder.num_patches, patch_size, embed_dim,
            decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio,
        )
        self.no_weight_decay = list(MAE_NO_DECAY if no_weight_decay is None else no_weight_decay)
        self._param_ndim = record_shapes(self)  # before any FSDP flattening (mmssl.optim)
        self._lr_scales = layer_scales(self._param_ndim, MAE_TOWERS, decays) if decays else None
        unmatched = unmatched_patterns(no_weight_decay or [], self._param_ndim)
        if unmatched:
            raise ValueError(f"model.no_weight_decay: {unmatched} match no parameter of the MAE")
        if init_encoder:
            if not checkpoint_exists(init_encoder):
                raise FileNotFoundError(f"model.init_encoder: no checkpoint file at {init_encoder!r}")
            state = read_state_dict(init_encoder)  # weights only, read once for both halves
            load_encoder(self.encoder, init_encoder, state=state)
            if load_decoder(self.decoder, state):
                rank_zero_info(f"MAE: decoder initialised from {init_encoder} too")
        self.encoder.grad_checkpointing = self.decoder.grad_checkpointing = grad_checkpointing
        options = compile_options(compile)
        if options is not None:
            compile_blocks(self, options, "the MAE")  # encoder and decoder blocks

    # ---- named stages (MAE forward_encoder / forward_decoder / forward_loss) -------------------

    def forward_encoder(
        self,
        images: torch.Tensor,
        mask_ratio: float,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Masking]:
        """(B, 3, H, W) -> visible tokens (B, 1+L_keep, D) and the masking used."""
        tokens, masking = self.encoder.forward_masked(images, mask_ratio, generator, noise)
        if masking is None:
            raise ValueError(f"forward_encoder needs mask_ratio in (0, 1), got {mask_ratio}")
        return tokens, masking

    def forward_decoder(self, tokens: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """(B, 1+L_keep, D) -> predicted patches (B, L, p*p*3)."""
        return self.decoder(tokens, ids_restore)

    def forward(
        self,
        images: torch.Tensor,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mask, encode, decode and score one batch.

        Args:
            images: (B, 3, H, W) normalised images.
            generator: optional RNG for the mask.
            noise: optional (B, L) noise that ranks the patches (``masking.sample_noise``).

        Returns:
            ``(loss, pred, mask)``: scalar, (B, L, p*p*3), (B, L) with 1 = masked.
        """
        tokens, masking = self.forward_encoder(images, self.mask_ratio, generator, noise)
        pred = self.forward_decoder(tokens, masking.ids_restore)
        target = patchify(images, self.patch_size)  # (B, L, p*p*3)
        loss = mae_loss(target, pred, masking.mask, self.norm_pix_loss)
        return loss, pred, masking.mask

    # ---- what callbacks call -------------------------------------------------------------------

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """Linear-probe feature of MAE: final-norm cls token, no masking. (B, 3, H, W) -> (B, D)."""
        return self.encoder(images)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Unmasked encoder tokens after the final norm: (B, 3, H, W) -> (B, 1+L, D)."""
        return self.encoder.forward_features(images)

    def forward_intermediates(
        self, images: torch.Tensor, pool: str = "cls", norm: bool = False
    ) -> list[torch.Tensor]:
        """Pooled (B, D) output of every encoder block, unmasked; see ``MaskedViT``."""
        return self.encoder.forward_intermediates(images, pool, norm)  # type: ignore[arg-type]

    @torch.no_grad()
    def reconstruct(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstruct images for display, in the input's normalised space.

        With ``norm_pix_loss`` the prediction is per-patch normalised (one mean and std over all
        pixels and channels of a patch); it is mapped back with the true patch mean and std, as
        MAE's visualisation of such models does. So each masked patch's overall brightness and
        contrast come from the original, while its hue and shape are the model's.

        Args:
            images: (B, 3, H, W) normalised images.
            generator: optional RNG, to show the same masks every time.

        Returns:
            ``(reconstruction, mask)``: (B, 3, H, W) images and (B, 1, H, W) with 1 = masked.
        """
        _, pred, mask = self(images, generator)
        pred = pred.float()
        if self.norm_pix_loss:
            target = patchify(images.float(), self.patch_size)
            mean = target.mean(dim=-1, keepdim=True)
            std = (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
            pred = pred * std + mean
        p = self.patch_size
        recon = unpatchify(pred, p)  # (B, 3, H, W)
        mask_img = unpatchify(mask.unsqueeze(-1).expand(-1, -1, p * p).float(), p)  # (B, 1, H, W)
        return recon, mask_img

    # ---- training ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # FSDP2 (ModelParallelStrategy): each transformer block a unit, then the root (mmssl.sharding).
        shard_model(self, attached_trainer(self))

    def on_fit_start(self) -> None:
        seed_per_rank(self.global_rank, self.trainer.world_size)  # each rank draws its own masks (MAE main_pretrain.py)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self(batch["image"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["image"].shape[0])
        trainer = attached_trainer(self)
        if trainer is not None and trainer.optimizers and logging_step(trainer):
            self.log("train/lr", trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Each sample's mask is a function of its pixels: the same masks at every validation, and
        # the same on 1 or N ranks whichever batch the sample lands in.
        images = batch["image"]
        loss, _, _ = self(images, noise=sample_noise(images, self.encoder.num_patches))
        # Every sample masks the same number of patches, so the batch loss is the mean of the
        # per-sample losses and weighting by the batch size gives the mean over the whole set.
        self.val_loss.update(loss.detach(), weight=images.shape[0])

    def on_validation_epoch_end(self) -> None:
        # Sum and count are reduced over ranks inside ``compute`` on every rank, including a rank
        # whose share of the validation shards was empty (Lightning's ``sync_dist`` logging runs
        # only on ranks that logged in a step, and hangs the others). Logged as the metric
        # object, so Lightning computes and resets it at the end of the epoch on every rank.
        self.log("val/loss", self.val_loss, prog_bar=True)

    def configure_optimizers(self) -> dict:
        # Estimating the steps loads the train dataloader, which the batch-size fallback reads.
        total_steps = self.trainer.estimated_stepping_batches
        lr = None if self.blr is None else lr_from_blr(self.blr, self.trainer, type(self).__name__)
        optimizer = build_optimizer(self.optimizer, self, self.no_weight_decay, self._param_ndim, self._lr_scales, lr)
        scheduler = warmup_cosine(optimizer, self.warmup_steps, total_steps, self.min_lr_ratio)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}
