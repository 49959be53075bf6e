"""A ViT encoder that runs on the visible patches only, built from timm's parts.

Shared by MAE and by CLIP's masked image tower (FLIP). The parameter names equal those of
``timm.models.vision_transformer.VisionTransformer`` (``cls_token``, ``pos_embed``,
``patch_embed.proj``, ``blocks.N``, ``norm``), so the state dict loads into
``timm.create_model("vit_*", num_classes=0, global_pool="token")`` unchanged
(``mmssl.checkpoints.layouts.mae_to_timm``).
Follows facebookresearch/mae ``models_mae.py`` (``forward_encoder``, ``initialize_weights``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Collection, Literal, Optional

import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch import nn

from mmssl.checkpoints.layouts import StateDict, fit_vit_state, vit_weights
from mmssl.checkpoints.model_file import read_vit_state
from mmssl.checkpoints.read import checkpoint_exists
from mmssl.models.masking import Masking, gather_tokens, random_masking
from mmssl.models.memory import run_blocks

log = logging.getLogger(__name__)

# timm's and MAE's ViTs both use LayerNorm with eps 1e-6; the export round trip depends on it.
LayerNorm = partial(nn.LayerNorm, eps=1e-6)


def sincos_pos_embed_2d(embed_dim: int, grid_size: int, cls_token: bool = False) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings (MAE ``get_2d_sincos_pos_embed``).

    The first half of the channels encodes the column index, the second half the row index, in
    the same order as MAE's released checkpoints.

    Args:
        embed_dim: D, divisible by 4.
        grid_size: patches per side.
        cls_token: prepend an all-zero row for the cls token.

    Returns:
        ((1 if cls_token else 0) + grid_size**2, D) float32.
    """
    if embed_dim % 4:
        raise ValueError(f"embed_dim must be divisible by 4 for 2-D sin-cos, got {embed_dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")  # (h, w) each
    omega = 1.0 / 10000 ** (torch.arange(embed_dim // 4, dtype=torch.float64) / (embed_dim / 4))

    def embed_1d(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega  # (h*w, D/4)
        return torch.cat([out.sin(), out.cos()], dim=1)  # (h*w, D/2)

    emb = torch.cat([embed_1d(cols), embed_1d(rows)], dim=1)  # (h*w, D)
    if cls_token:
        emb = torch.cat([torch.zeros(1, embed_dim, dtype=emb.dtype), emb], dim=0)
    return emb.float()


def init_vit_weights(module: nn.Module) -> None:
    """MAE ``_init_weights``: xavier-uniform Linear weights, zero biases, unit LayerNorms."""
    if isinstance(module, nn.Linear):
        # MAE follows the official JAX ViT: xavier_uniform, not timm's trunc_normal.
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class MaskedViT(nn.Module):
    """ViT encoder with a cls token and fixed sin-cos position embeddings that can drop patches.

    Args:
        image_size: input side in pixels; must be divisible by ``patch_size``.
        patch_size: patch side in pixels.
        in_chans: input channels.
        embed_dim: token width D (divisible by 4 for the sin-cos embedding).
        depth: number of transformer blocks.
        num_heads: attention heads; must divide ``embed_dim``.
        mlp_ratio: MLP hidden width / D.
        qkv_bias: bias in the qkv projection (True in MAE and timm ViTs).
        drop_path_rate: stochastic depth at the last block (linear in depth); 0 for pretraining.
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size <= 0 or patch_size <= 0 or image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be a positive multiple of "
                f"patch_size ({patch_size})"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.image_size = image_size
        self.patch_size = patch_size
        self.grid_size = image_size // patch_size
        self.num_patches = self.grid_size**2
        self.embed_dim = embed_dim

        self.patch_embed = PatchEmbed(image_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # MAE sec. A.1: fixed sin-cos embeddings, stored (not trained) under timm's name.
        self.pos_embed = nn.Parameter(
            torch.zeros(1, 1 + self.num_patches, embed_dim), requires_grad=False
        )
        dpr = [drop_path_rate * i / max(1, depth - 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            Block(
                embed_dim, num_heads, mlp_ratio,
                qkv_bias=qkv_bias, drop_path=dpr[i], norm_layer=LayerNorm,
            )
            for i in range(depth)
        )
        self.norm = LayerNorm(embed_dim)
        self.grad_checkpointing = False  # activation checkpointing of the blocks (mmssl.models.memory)
        self.init_weights()

    def init_weights(self) -> None:
        """MAE ``initialize_weights``: sin-cos pos-embed, xavier patch projection, N(0, .02) cls."""
        pos = sincos_pos_embed_2d(self.embed_dim, self.grid_size, cls_token=True)
        self.pos_embed.data.copy_(pos.unsqueeze(0))
        w = self.patch_embed.proj.weight.data
        # Treat the conv as a Linear over flattened patches, as MAE does.
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.cls_token, std=0.02)
        self.blocks.apply(init_vit_weights)
        self.norm.apply(init_vit_weights)

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens with position embeddings, no cls token.

        Args:
            images: (B, C, H, W) with H = W = ``image_size``.

        Returns:
            (B, L, D).
        """
        if images.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"expected images of {self.image_size}x{self.image_size}, "
                f"got {tuple(images.shape[-2:])}"
            )
        x = self.patch_embed(images)  # (B, L, D)
        return x + self.pos_embed[:, 1:, :]

    def prepend_cls(self, x: torch.Tensor) -> torch.Tensor:
        """(B, K, D) -> (B, 1+K, D) with the cls token (plus its position embedding) first."""
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1)

    def forward_masked(
        self,
        images: torch.Tensor,
        mask_ratio: float,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Masking | None]:
        """MAE ``forward_encoder``: embed, drop ``mask_ratio`` of the patches, run the blocks.

        Args:
            images: (B, C, H, W).
            mask_ratio: fraction of patches removed per sample, in [0, 1); 0 keeps all patches
                in their original order and returns no masking.
            generator: optional RNG for the mask.
            noise: optional (B, L) noise that ranks the patches (see ``random_masking``).

        Returns:
            ``(tokens, masking)``: tokens (B, 1+L_keep, D) after the final norm (cls first);
            masking a :class:`Masking` or ``None`` when ``mask_ratio == 0``.
        """
        x = self.embed_patches(images)  # (B, L, D)
        masking = None
        if mask_ratio > 0:
            masking = random_masking(x, mask_ratio, generator, noise)
            x = gather_tokens(x, masking.ids_keep)  # (B, L_keep, D): only these are computed
        elif mask_ratio < 0:
            raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
        x = self.prepend_cls(x)  # (B, 1+L_keep, D)
        x = run_blocks(self.blocks, x, self.grad_checkpointing)
        return self.norm(x), masking

    def forward_features(self, images: torch.Tensor, mask_ratio: float = 0.0) -> torch.Tensor:
        """All tokens after the final norm (timm's ``forward_features``).

        Args:
            images: (B, C, H, W).
            mask_ratio: fraction of patches dropped, in [0, 1).

        Returns:
            (B, 1+L_keep, D), cls token first.
        """
        return self.forward_masked(images, mask_ratio)[0]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Final-norm cls token (timm ``global_pool="token"``): (B, C, H, W) -> (B, D)."""
        return self.forward_features(images)[:, 0]

    def forward_intermediates(
        self, images: torch.Tensor, pool: Literal["cls", "avg"] = "cls", norm: bool = False
    ) -> list[torch.Tensor]:
        """Pooled output of every block, unmasked, for layer-wise probing.

        Args:
            images: (B, C, H, W).
            pool: ``"cls"`` takes the cls token, ``"avg"`` averages the patch tokens.
            norm: apply the encoder's final LayerNorm to each block's output first.

        Returns:
            ``depth`` tensors of shape (B, D), block 1 first; the last one with ``norm=True``
            and ``pool="cls"`` equals ``forward(images)``.
        """
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', got {pool!r}")
        x = self.prepend_cls(self.embed_patches(images))  # (B, 1+L, D)
        outputs = []
        for block in self.blocks:
            x = block(x)
            y = self.norm(x) if norm else x
            outputs.append(y[:, 0] if pool == "cls" else y[:, 1:].mean(dim=1))
        return outputs


def load_encoder(
    model: nn.Module, path: str, new_keys: Collection[str] = (), state: Optional[StateDict] = None
) -> tuple[list[str], list[str]]:
    """Initialise a ViT (``MaskedViT`` or a timm ``VisionTransformer``) from a checkpoint file.

    Reads an mmssl MAE, CLIP (timm tower) or ImageClassifier checkpoint, an exported timm state
    dict or an MAE release (:func:`mmssl.checkpoints.layouts.vit_weights`), weights only. A head
    of another shape is dropped, a position embedding for another grid resampled, keys the model
    lacks ignored (:func:`mmssl.checkpoints.layouts.fit_vit_state`). Note a timm supervised
    checkpoint brings its learned position embedding, kept fixed in a ``MaskedViT``.

    Args:
        model: the ViT to fill in place.
        path: checkpoint file.
        new_keys: model keys the file need not provide (a classifier's new head and ``fc_norm``).
        state: the file's tensors when the caller has read them already.

    Returns:
        ``(missing, ignored)``: the model's keys left as built and the file's keys not loaded.
    """
    if state is None:
        if not checkpoint_exists(path):
            raise FileNotFoundError(f"model.init_encoder: no checkpoint file at {path!r}")
        # Weights only, its kind from the recorded class or the run's config.yaml before the keys.
        state = read_vit_state(path, "model.init_encoder")
    grid = tuple(model.patch_embed.grid_size)
    to_load, missing, ignored = fit_vit_state(
        vit_weights(state, path), model.state_dict(), grid, int(getattr(model, "num_prefix_tokens", 1)), path, new_keys)
    model.load_state_dict(to_load, strict=False)
    log.info("initialised encoder from %s (ignored %d keys: %s)", path, len(ignored), ignored[:8])
    return missing, ignored
