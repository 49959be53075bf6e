"""Multimodal masked autoencoder (M3AE, Geng et al. 2022): one ViT over image patches and caption tokens.

Follows young-geng/m3ae_public ``m3ae/model.py`` (``MaskedMultimodalAutoencoder``) and
``m3ae_main.py``: the visible image patches and the visible caption tokens, each with its position
and a learned modality ("type") embedding, go through one encoder behind a cls token; a light
decoder fills both with a mask token and predicts the masked patches' normalised pixels (MSE, as
MAE) and the masked tokens' ids (cross-entropy). Loss ``image_mse + text_loss_weight * text_ce``.

Built from MAE's parts: the image side is :class:`~mmssl.models.vit.MaskedViT` (patch embedding,
cls, blocks, norm), the decoder is :class:`~mmssl.models.mae.MAEDecoder` (its embedding, mask
token, blocks, norm, pixel head) plus a text head; loss :func:`mmssl.losses.mae_loss`; optimizer,
``blr`` scaling and schedule are MAE's. Captions are tokenized by open_clip's BPE.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from open_clip.tokenizer import SimpleTokenizer
from torch import nn
from torchmetrics import MeanMetric

from mmssl.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from mmssl.distributed import seed_per_rank
from mmssl.log_cadence import logging_step
from mmssl.losses import mae_loss
from mmssl.models.mae import MAE, MAE_NO_DECAY, MAEDecoder, mae_adamw
from mmssl.models.masking import Masking, gather_tokens, patchify, random_masking, sample_noise
from mmssl.models.token_masking import (
    TokenMasking,
    check_share,
    masked_token_ce,
    padding_after_eot,
    random_token_masking,
)
from mmssl.models.vit import MaskedViT
from mmssl.optim import check_layer_decay, check_warmup, layer_scales, record_shapes, unmatched_patterns
from mmssl.sharding import shard_model
from mmssl.upstream import attached_trainer


def sincos_pos_embed_1d(embed_dim: int, length: int) -> torch.Tensor:
    """Fixed 1-D sine-cosine position embeddings (M3AE / MAE ``get_1d_sincos_pos_embed_from_grid``).

    Returns:
        (length, D) float32: sines of the first D/2 frequencies, then cosines.
    """
    omega = 1.0 / 10000 ** (torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2))  # (D/2,)
    out = torch.arange(length, dtype=torch.float64).unsqueeze(1) * omega  # (T, D/2)
    return torch.cat([out.sin(), out.cos()], dim=1).float()  # (T, D)


def key_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, N) bool, True = a real token -> (B, 1, 1, N) additive attention bias (timm ``attn_mask``).

    Filler slots and padding are never attended to (M3AE passes its padding mask the same way);
    every row has the cls token, so no softmax row is empty.
    """
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return bias.masked_fill(~valid, torch.finfo(dtype).min)[:, None, None, :]


def restore(visible: torch.Tensor, mask_token: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
    """MAE ``forward_decoder``: append mask tokens and unshuffle.

    Args:
        visible: (B, K, D) kept tokens in shuffled order.
        mask_token: (1, 1, D).
        ids_restore: (B, N) inverse of the shuffle, N >= K.

    Returns:
        (B, N, D) in original order, mask tokens at the removed positions.
    """
    batch, length, dim = visible.shape[0], ids_restore.shape[1], visible.shape[2]
    x = torch.cat([visible, mask_token.expand(batch, length - visible.shape[1], -1)], dim=1)  # (B, N, D)
    return torch.gather(x, 1, ids_restore.unsqueeze(-1).expand(-1, -1, dim))


def drop_one_token(padding: torch.Tensor, positions: torch.Tensor) -> TokenMasking:
    """A :class:`TokenMasking` that removes exactly the token at ``positions`` of each caption.

    Args:
        padding: (B, T) True at padding (neither kept nor a target).
        positions: (B,) the token to remove per caption.

    Returns:
        ``ids_keep`` (B, K) the other real tokens in caption order, ``ids_restore`` (B, T),
        ``mask`` (B, T) 1 at ``positions`` only, ``keep_valid`` (B, K).
    """
    batch = padding.shape[0]
    target = torch.zeros_like(padding)
    target[torch.arange(batch, device=padding.device), positions] = True
    # Kept tokens first in caption order, then the target, then padding (a stable sort of 0/1/2).
    key = torch.where(padding, 2, target.long())  # (B, T)
    ids_shuffle = torch.argsort(key, dim=1, stable=True)  # (B, T)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    kept = (key == 0).sum(dim=1)  # (B,)
    width = int(kept.max())
    keep_valid = torch.arange(width, device=padding.device).unsqueeze(0) < kept.unsqueeze(1)  # (B, K)
    return TokenMasking(ids_shuffle[:, :width], ids_restore, target.float(), keep_valid)


class M3AEOutput(NamedTuple):
    """One batch's figures: ``loss``, ``image_loss``, ``text_loss`` (mean over the batch's masked
    tokens, 0 if none), and the sums behind the text figures: ``text_ce_sum``, ``text_correct``,
    ``text_count`` (masked tokens), ``captions_without_target`` (captions with nothing masked)."""

    loss: torch.Tensor
    image_loss: torch.Tensor
    text_loss: torch.Tensor
    text_ce_sum: torch.Tensor
    text_correct: torch.Tensor
    text_count: torch.Tensor
    captions_without_target: torch.Tensor


# The one encoder over image patches and caption tokens, with what feeds it (its stem: the token and
# modality embeddings beside the patch embedding), for layer decay; the decoder stays at 1.
M3AE_TOWERS = {"encoder": ("encoder.*", "token_embed.*", "image_type", "text_type")}


class M3AE(LightningModule):
    """M3AE pretraining on image-text pairs.

    Args:
        image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio: the ViT encoder (as MAE).
        decoder_embed_dim, decoder_depth, decoder_num_heads: the decoder (as MAE).
        image_mask_ratio: share of patches removed, in (0, 1) (M3AE: 0.75).
        text_mask_ratio: share of each caption's maskable tokens removed, in [0, 1) (M3AE: 0.75).
        text_loss_weight: w in ``image_mse + w * text_ce``, >= 0.
        text_length: captions' context length (open_clip BPE, padded with 0 after end-of-text).
        norm_pix_loss: per-patch normalised pixel targets (M3AE, MAE).
        optimizer, blr, warmup_steps, min_lr_ratio, no_weight_decay: as MAE (``MAE.configure_optimizers``).
        image_mean, image_std: normalisation (linked to the data module).
        layer_decay: layer-wise LR decay of the shared encoder, as MAE's (:data:`M3AE_TOWERS`): block N of
            D trains at ``decay ** (D - N)`` x the LR; its stem (patch embedding, class token, the
            token embedding and both modality embeddings) at ``decay ** (D + 1)``; the encoder's norm
            and the decoder at 1. ``None``: no decay.
    """

    trim_text_padding = False  # the full context: validation masks then depend on the sample only

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
        image_mask_ratio: float = 0.75,
        text_mask_ratio: float = 0.75,
        text_loss_weight: float = 0.5,
        text_length: int = 77,
        norm_pix_loss: bool = True,
        optimizer: OptimizerCallable = mae_adamw,
        blr: Optional[float] = 1.5e-4,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        image_mean: tuple[float, float, float] = IMAGENET_MEAN,
        image_std: tuple[float, float, float] = IMAGENET_STD,
        no_weight_decay: Optional[list[str]] = None,
        layer_decay: Optional[float] = None,
    ) -> None:
        super().__init__()
        decays = check_layer_decay("model.init_args.layer_decay", layer_decay, tuple(M3AE_TOWERS))
        check_share("model.image_mask_ratio", image_mask_ratio, high_open=True)
        if image_mask_ratio == 0.0:
            raise ValueError("model.image_mask_ratio must be in (0, 1), got 0.0: no image targets")
        check_share("model.text_mask_ratio", text_mask_ratio, high_open=True)
        if text_loss_weight < 0:
            raise ValueError(f"model.text_loss_weight must be >= 0, got {text_loss_weight}")
        if text_length < 2:
            raise ValueError(f"model.text_length must be >= 2 (start and end of text), got {text_length}")
        check_warmup("model.warmup_steps", warmup_steps)
        self.save_hyperparameters(ignore=["optimizer"])
        self.image_size, self.patch_size = image_size, patch_size
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.image_mask_ratio, self.text_mask_ratio = image_mask_ratio, text_mask_ratio
        self.text_loss_weight, self.norm_pix_loss = text_loss_weight, norm_pix_loss
        self.optimizer, self.blr = optimizer, blr
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.tokenizer = SimpleTokenizer(context_length=text_length)  # open_clip's BPE, shipped with it
        self.special_ids = (int(self.tokenizer.sot_token_id), int(self.tokenizer.eot_token_id))
        vocab = int(self.tokenizer.vocab_size)

        self.encoder = MaskedViT(image_size, patch_size, 3, embed_dim, depth, num_heads, mlp_ratio)
        self.token_embed = nn.Embedding(vocab, embed_dim)
        self.register_buffer("text_pos", sincos_pos_embed_1d(embed_dim, text_length)[None], persistent=False)
        # M3AE model.py: learned modality embeddings, added to every image / text token.
        self.image_type = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.text_type = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # Not named "decoder": checkpoints of MAE are told by encoder.* + decoder.* (checkpoints.layouts).
        self.mm_decoder = MAEDecoder(self.encoder.num_patches, patch_size, embed_dim, decoder_embed_dim,
                                     decoder_depth, decoder_num_heads, mlp_ratio)
        self.register_buffer("decoder_text_pos", sincos_pos_embed_1d(decoder_embed_dim, text_length)[None],
                             persistent=False)
        self.decoder_image_type = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_text_type = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.text_pred = nn.Linear(decoder_embed_dim, vocab)
        for p in (self.image_type, self.text_type, self.decoder_image_type, self.decoder_text_type):
            nn.init.normal_(p, std=0.02)
        nn.init.normal_(self.token_embed.weight, std=0.02)

        # Sums and counts, reduced over ranks: per-sample image MSE weighted by samples; token CE
        # and top-1 weighted by masked tokens, so the set's figures are means over all its tokens.
        self.val_image_loss = MeanMetric()
        self.val_text_loss = MeanMetric()
        self.val_token_top1 = MeanMetric()
        self.val_loss = self.val_image_loss + text_loss_weight * self.val_text_loss  # computed from the two
        self.no_weight_decay = list(MAE_NO_DECAY if no_weight_decay is None else no_weight_decay)
        self._param_ndim = record_shapes(self)  # before any FSDP flattening (mmssl.optim)
        self._lr_scales = layer_scales(self._param_ndim, M3AE_TOWERS, decays) if decays else None  # MAE's reads it
        unmatched = unmatched_patterns(no_weight_decay or [], self._param_ndim)
        if unmatched:
            raise ValueError(f"model.no_weight_decay: {unmatched} match no parameter of the M3AE")

    # ---- named stages --------------------------------------------------------------------------

    def _blocks(self, blocks: nn.ModuleList, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        bias = key_bias(valid, x.dtype)  # (B, 1, 1, N)
        for block in blocks:
            x = block(x, attn_mask=bias)
        return x

    def forward_encoder(
        self,
        images: torch.Tensor,
        tokens: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        image_noise: Optional[torch.Tensor] = None,
        text_noise: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Masking, TokenMasking, torch.Tensor]:
        """Encode the visible patches and tokens together.

        Args:
            images: (B, 3, H, W); tokens: (B, T) ids, T <= text_length.
            generator, image_noise (B, L), text_noise (B, T): as ``random_masking``.

        Returns:
            ``(x, image_masking, text_masking, padding)``: x (B, 1+L_keep+K, D) after the final
            norm ([cls, visible patches, kept tokens]), the two maskings, padding (B, T).
        """
        if tokens.shape[1] > self.text_pos.shape[1]:
            raise ValueError(f"captions of {tokens.shape[1]} tokens exceed model.text_length={self.text_pos.shape[1]}")
        image = self.encoder.embed_patches(images) + self.image_type  # (B, L, D)
        image_masking = random_masking(image, self.image_mask_ratio, generator, image_noise)
        padding = padding_after_eot(tokens, self.special_ids[1])  # (B, T)
        text_masking = random_token_masking(tokens, self.text_mask_ratio, self.special_ids, padding,
                                            generator, text_noise)
        return self._encode(image, tokens, image_masking, text_masking), image_masking, text_masking, padding

    def _encode(self, image: torch.Tensor, tokens: torch.Tensor, image_masking: Masking,
                text_masking: TokenMasking) -> torch.Tensor:
        """Embedded patches (B, L, D) and (B, T) ids under the two maskings -> (B, 1+L_keep+K, D)."""
        image = gather_tokens(image, image_masking.ids_keep)  # (B, L_keep, D)
        text = self.token_embed(tokens) + self.text_pos[:, :tokens.shape[1]] + self.text_type  # (B, T, D)
        text = gather_tokens(text, text_masking.ids_keep)  # (B, K, D)
        x = torch.cat([self.encoder.prepend_cls(image), text], dim=1)  # (B, 1+L_keep+K, D)
        seen = torch.ones(x.shape[0], x.shape[1] - text.shape[1], dtype=torch.bool, device=x.device)
        x = self._blocks(self.encoder.blocks, x, torch.cat([seen, text_masking.keep_valid], dim=1))
        return self.encoder.norm(x)

    def forward_decoder(
        self, x: torch.Tensor, image_masking: Masking, text_masking: TokenMasking, padding: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 1+L_keep+K, D) -> predicted patches (B, L, p*p*3) and text states (B, T, D_dec)."""
        dec = self.mm_decoder
        x = dec.embed(x)  # (B, 1+L_keep+K, D_dec)
        kept = image_masking.ids_keep.shape[1]
        cls, image, text = x[:, :1], x[:, 1:1 + kept], x[:, 1 + kept:]
        image = restore(image, dec.mask_token, image_masking.ids_restore)  # (B, L, D_dec)
        # Filler slots of ids_keep hold removed or padding tokens' encodings: replace by the mask token.
        text = torch.where(text_masking.keep_valid.unsqueeze(-1), text, dec.mask_token.to(text.dtype))
        text = restore(text, dec.mask_token, text_masking.ids_restore)  # (B, T, D_dec)
        length = text.shape[1]
        x = torch.cat([
            cls + dec.pos_embed[:, :1],
            image + dec.pos_embed[:, 1:] + self.decoder_image_type,
            text + self.decoder_text_pos[:, :length] + self.decoder_text_type,
        ], dim=1)  # (B, 1+L+T, D_dec)
        seen = torch.ones(x.shape[0], x.shape[1] - length, dtype=torch.bool, device=x.device)
        x = dec.norm(self._blocks(dec.blocks, x, torch.cat([seen, ~padding], dim=1)))
        return dec.pred(x[:, 1:x.shape[1] - length]), x[:, x.shape[1] - length:]

    def forward(
        self,
        images: torch.Tensor,
        tokens: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        image_noise: Optional[torch.Tensor] = None,
        text_noise: Optional[torch.Tensor] = None,
    ) -> M3AEOutput:
        """Mask, encode, decode and score one batch of (B, 3, H, W) images and (B, T) captions."""
        x, image_masking, text_masking, padding = self.forward_encoder(images, tokens, generator, image_noise,
                                                                       text_noise)
        pred, text_states = self.forward_decoder(x, image_masking, text_masking, padding)
        image_loss = mae_loss(patchify(images, self.patch_size), pred, image_masking.mask, self.norm_pix_loss)
        targets = text_masking.mask.bool()  # (B, T)
        logits = self.text_pred(text_states[targets])  # (M, V): the masked tokens only
        ce_sum, correct, count = masked_token_ce(logits, tokens[targets])
        text_loss = ce_sum / count.clamp_min(1)  # M3AE: mean over the batch's masked tokens; 0 if none
        loss = image_loss + self.text_loss_weight * text_loss
        empty = (~targets.any(dim=1)).sum()
        return M3AEOutput(loss, image_loss, text_loss, ce_sum, correct, count, empty)

    def predict_masked_tokens(self, images: torch.Tensor, tokens: torch.Tensor,
                              positions: torch.Tensor) -> torch.Tensor:
        """Logits of one removed token per caption, every image patch and every other token seen.

        M3AE's text masking drops tokens (MAE-style), so "masking a word" removes exactly that one
        token and lets the decoder's mask token at its place predict it (``text_pred``).

        Args:
            images: (B, 3, H, W); tokens: (B, T) ids; positions: (B,) index of the token to remove,
                a real token (not padding).

        Returns:
            (B, V) logits at ``positions``.
        """
        batch = tokens.shape[0]
        padding = padding_after_eot(tokens, self.special_ids[1])  # (B, T)
        rows = torch.arange(batch, device=tokens.device)
        if bool(padding[rows, positions].any()):
            raise ValueError("positions must name real caption tokens, not padding")
        image = self.encoder.embed_patches(images) + self.image_type  # (B, L, D)
        all_patches = torch.arange(image.shape[1], device=images.device).expand(batch, -1)  # (B, L)
        image_masking = Masking(all_patches, all_patches, torch.zeros(batch, image.shape[1], device=images.device))
        text_masking = drop_one_token(padding, positions)
        x = self._encode(image, tokens, image_masking, text_masking)
        _, text_states = self.forward_decoder(x, image_masking, text_masking, padding)  # (B, T, D_dec)
        return self.text_pred(text_states[rows, positions])  # (B, V)

    # ---- what callbacks call: the image side, unmasked ---------------------------------------

    def _image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.prepend_cls(self.encoder.embed_patches(images) + self.image_type)  # (B, 1+L, D)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Unmasked image tokens after the final norm, no text: (B, 3, H, W) -> (B, 1+L, D)."""
        x = self._image_tokens(images)
        for block in self.encoder.blocks:
            x = block(x)
        return self.encoder.norm(x)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """Final-norm cls token of the image alone: (B, 3, H, W) -> (B, D)."""
        return self.forward_features(images)[:, 0]

    def forward_intermediates(self, images: torch.Tensor, pool: str = "cls", norm: bool = False) -> list[torch.Tensor]:
        """Pooled (B, D) output of every encoder block on the image alone (as ``MaskedViT``)."""
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', got {pool!r}")
        x, outputs = self._image_tokens(images), []
        for block in self.encoder.blocks:
            x = block(x)
            y = self.encoder.norm(x) if norm else x
            outputs.append(y[:, 0] if pool == "cls" else y[:, 1:].mean(dim=1))
        return outputs

    # ---- training ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # FSDP2 (ModelParallelStrategy): each timm Block a unit, then the root (mmssl.sharding).
        shard_model(self, attached_trainer(self))

    def on_fit_start(self) -> None:
        seed_per_rank(self.global_rank, self.trainer.world_size)  # each rank draws its own masks

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch["image"], batch["text"])
        size = batch["image"].shape[0]
        self.log("train/loss", out.loss, prog_bar=True, batch_size=size)
        self.log_dict({"train/image_loss": out.image_loss, "train/text_loss": out.text_loss}, batch_size=size)
        self.log("train/captions_without_target", out.captions_without_target.float(), reduce_fx="sum")
        trainer = attached_trainer(self)
        if trainer is not None and trainer.optimizers and logging_step(trainer):
            self.log("train/lr", trainer.optimizers[0].param_groups[0]["lr"])
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Masks from each sample's pixels (masking.sample_noise): the same on 1 or N ranks.
        images, tokens = batch["image"], batch["text"]
        out = self(images, tokens, image_noise=sample_noise(images, self.encoder.num_patches),
                   text_noise=sample_noise(images, tokens.shape[1], seed=1))
        self.val_image_loss.update(out.image_loss.detach(), weight=images.shape[0])
        count = out.text_count.float()
        self.val_text_loss.update(out.text_loss.detach(), weight=count)  # ce_sum / count, weight count
        self.val_token_top1.update(out.text_correct.float() / count.clamp_min(1), weight=count)

    def on_validation_epoch_end(self) -> None:
        # Logged as metric objects: Lightning computes them on every rank, one without a batch
        # included, reducing sums and counts inside compute (as MAE's val_loss), then resets them.
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/image_loss", self.val_image_loss)
        self.log("val/text_loss", self.val_text_loss)
        self.log("val/masked_token_top1", self.val_token_top1)

    # MAE main_pretrain.py's AdamW groups, blr x global batch / 256 and per-step warm-up + cosine,
    # reading the same attributes (optimizer, no_weight_decay, _param_ndim, _lr_scales, blr, ...).
    configure_optimizers = MAE.configure_optimizers
