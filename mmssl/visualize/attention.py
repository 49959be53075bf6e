"""Attention of ViT image encoders: the cls token's per-head attention and attention rollout.

The weights are read from the running model with forward hooks, never by copying its blocks:

- timm ``Attention`` (MAE's ``MaskedViT``, exported timm files, open_clip's timm towers) and
  open_clip's own ``Attention``: the ``attn_drop`` module receives the softmaxed weights when the
  fused kernel is off (the hook point of timm's ``AttentionExtract``); the fused kernel is
  switched off on each module for the recorded forward only.
- ``nn.MultiheadAttention`` (open_clip's ``VisionTransformer`` blocks): a pre-hook asks for the
  per-head weights (``need_weights=True, average_attn_weights=False``) and a hook keeps them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

import torch
from torch import Tensor, nn

HeadFusion = Literal["mean", "max", "min"]


@dataclass
class VisionTower:
    """The ViT inside a model, as attention maps need it.

    Attributes:
        module: the ViT whose attention layers are hooked.
        forward: runs it on (B, 3, H, W) normalised images (the output is not used).
        num_prefix_tokens: tokens before the patches (cls, registers).
        grid_size: (h, w) patches.
    """

    module: nn.Module
    forward: Callable[[Tensor], object]
    num_prefix_tokens: int
    grid_size: tuple[int, int]


def _grid(size) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def vision_tower(model: nn.Module) -> VisionTower:
    """Find the ViT of an mmssl ``MAE`` or ``CLIP`` or of a ``TimmEncoder`` (exported timm file).

    Args:
        model: a module loaded by ``mmssl.evaluation.encoders.load_model``.

    Returns:
        The tower to hook; raises ``TypeError`` for an image tower that is not a ViT.
    """
    encoder = getattr(model, "encoder", None)  # MAE: MaskedViT
    if encoder is not None and hasattr(encoder, "blocks") and hasattr(encoder, "grid_size"):
        return VisionTower(encoder, encoder.forward_features, 1, _grid(encoder.grid_size))
    inner = getattr(model, "model", None)
    visual = getattr(inner, "visual", None)  # CLIP: open_clip model
    if visual is not None:
        trunk = getattr(visual, "trunk", None)  # open_clip TimmModel tower
        if trunk is not None and hasattr(trunk, "patch_embed"):
            return VisionTower(trunk, trunk.forward_features, int(getattr(trunk, "num_prefix_tokens", 1)),
                               _grid(trunk.patch_embed.grid_size))
        if hasattr(visual, "transformer") and hasattr(visual, "grid_size"):
            return VisionTower(visual, visual, 1, _grid(visual.grid_size))
        raise TypeError(f"image tower {type(visual).__name__} is not a ViT: it has no attention maps")
    if inner is not None and hasattr(inner, "patch_embed") and hasattr(inner, "blocks"):  # TimmEncoder
        return VisionTower(inner, inner.forward_features, int(getattr(inner, "num_prefix_tokens", 1)),
                           _grid(inner.patch_embed.grid_size))
    raise TypeError(f"{type(model).__name__} holds no ViT image encoder (MAE, CLIP or a timm ViT)")


@contextlib.contextmanager
def record_attention(module: nn.Module) -> Iterator[list[Tensor]]:
    """Collect the attention weights of every attention layer of ``module`` in forward order.

    Args:
        module: a ViT (see the module docstring for the attention layers it finds).

    Yields:
        A list that the forward passes inside fill with (B, heads, T, T) weights (rows sum to 1).
    """
    weights: list[Tensor] = []
    handles, fused = [], []
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention):
            def ask(_m, args, kwargs):
                return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

            def keep(_m, _args, _kwargs, output):
                weights.append(output[1].detach())  # (B, heads, T, T)

            handles.append(m.register_forward_pre_hook(ask, with_kwargs=True))
            handles.append(m.register_forward_hook(keep, with_kwargs=True))
        elif isinstance(getattr(m, "attn_drop", None), nn.Module) and hasattr(m, "num_heads"):
            for flag in ("fused_attn", "use_fsdpa"):  # timm's / open_clip's switch to SDPA
                if getattr(m, flag, False):
                    fused.append((m, flag))
                    setattr(m, flag, False)

            def keep_probs(_d, _inputs, output, heads=m.num_heads):
                t = output.shape[-1]
                weights.append(output.detach().reshape(-1, heads, t, t))  # open_clip: (B*heads, T, T)

            handles.append(m.attn_drop.register_forward_hook(keep_probs))
    if not handles:
        raise TypeError(f"{type(module).__name__} has no attention layer that can be recorded")
    try:
        yield weights
    finally:
        for handle in handles:
            handle.remove()
        for m, flag in fused:
            setattr(m, flag, True)


@torch.no_grad()
def attention_weights(tower: VisionTower, images: Tensor) -> list[Tensor]:
    """Every block's attention for ``images``: a list of depth (B, heads, T, T) tensors."""
    with record_attention(tower.module) as weights:
        tower.forward(images)
    return weights


def fuse_heads(attention: Tensor, how: HeadFusion = "mean") -> Tensor:
    """(B, heads, T, T) -> (B, T, T): mean (Abnar & Zuidema), max or min over heads."""
    if how == "mean":
        return attention.mean(dim=1)
    if how in ("max", "min"):
        return getattr(attention, how)(dim=1).values
    raise ValueError(f"head fusion must be mean, max or min, got {how!r}")


def attention_rollout(attentions: Sequence[Tensor], head_fusion: HeadFusion = "mean") -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, eq. 1): how much each token's output draws on
    each input token through all layers.

    Each layer's head-fused weights A get the residual connection as an identity, rows
    renormalised: Ã = 0.5 A + 0.5 I (their sec. 3; for max/min fusion A's rows are first made to
    sum to 1); the rollout is Ã_L ... Ã_2 Ã_1.

    Args:
        attentions: depth tensors (B, heads, T, T), first block first.
        head_fusion: how heads are combined per layer.

    Returns:
        (B, T, T); each row sums to 1.
    """
    if not attentions:
        raise ValueError("attention_rollout needs at least one layer's attention")
    result = None
    for attention in attentions:
        fused = fuse_heads(attention.float(), head_fusion)  # (B, T, T)
        fused = fused / fused.sum(dim=-1, keepdim=True)
        eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
        layer = 0.5 * fused + 0.5 * eye
        result = layer if result is None else layer @ result  # later layers on the left
    return result


def cls_patch_map(matrix: Tensor, num_prefix_tokens: int, grid_size: tuple[int, int]) -> Tensor:
    """The cls token's row over the patches, as a map over the patch grid.

    Args:
        matrix: (..., T, T) attention or rollout, T = prefix + h * w; token 0 is the cls token.
        num_prefix_tokens: tokens before the patches.
        grid_size: (h, w).

    Returns:
        (..., h, w), renormalised to sum to 1 over the patches (the prefix tokens' share dropped).
    """
    h, w = grid_size
    if matrix.shape[-1] != num_prefix_tokens + h * w:
        raise ValueError(f"attention over {matrix.shape[-1]} tokens does not match {num_prefix_tokens} prefix "
                         f"tokens + a {h}x{w} patch grid")
    row = matrix[..., 0, num_prefix_tokens:]  # (..., h*w), patches in row-major order
    row = row / row.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(row.dtype).tiny)
    return row.reshape(*row.shape[:-1], h, w)


@torch.no_grad()
def attention_maps(model: nn.Module, images: Tensor, head_fusion: HeadFusion = "mean") -> dict[str, Tensor]:
    """The cls token's last-layer attention per head and the rollout over all layers.

    Args:
        model: MAE, CLIP or a ``TimmEncoder`` (``mmssl.evaluation.encoders.load_model``), in eval mode.
        images: (B, 3, H, W) normalised as the model expects.
        head_fusion: head fusion of the rollout.

    Returns:
        ``heads`` (B, heads, h, w) and ``rollout`` (B, h, w), each summing to 1 over the patches.
    """
    tower = vision_tower(model)
    weights = attention_weights(tower, images)
    return {
        "heads": cls_patch_map(weights[-1].float(), tower.num_prefix_tokens, tower.grid_size),
        "rollout": cls_patch_map(attention_rollout(weights, head_fusion), tower.num_prefix_tokens, tower.grid_size),
    }
