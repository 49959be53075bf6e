"""Dense patch-to-text similarity of a CLIP (MaskCLIP, Zhou et al. 2022, sec. 3.2).

CLIP's image embedding is the cls token after the final norm (``ln_post``) and the projection
(``proj``). MaskCLIP passes every patch token through the same norm and projection, which puts
each patch in the joint space, where its cosine similarity to a caption's embedding says how
well that patch matches the caption.

MaskCLIP also changes the last attention layer: each token keeps its own value embedding instead
of a query-key mixture of all tokens (their Fig. 2; the residual and the MLP stay), since the
last layer's attention pools the image into the cls token and blurs the patches' locality.
``value_path=True`` does the same with an attention mask on the last block (each token attends
only to itself, so its attention output is ``out_proj(v_i)``), in open_clip's own block.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _visual(model: nn.Module) -> nn.Module:
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is None or not hasattr(model, "encode_text"):
        raise TypeError(f"{type(model).__name__} is not a CLIP (no image and text towers): "
                        "patch-text similarity needs an mmssl CLIP checkpoint or open_clip file")
    if not (hasattr(visual, "ln_post") and hasattr(visual, "grid_size")):
        raise TypeError(f"image tower {type(visual).__name__} is not an open_clip VisionTransformer")
    if getattr(visual, "attn_pool", None) is not None or getattr(visual, "final_ln_after_pool", False):
        raise TypeError("patch-text similarity needs an image tower that normalises every token before "
                        "pooling (no attention pooler, final_ln_after_pool off)")
    return visual


def grid_size(model: nn.Module) -> tuple[int, int]:
    """(h, w) patches of a CLIP's image tower."""
    size = _visual(model).grid_size
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


@contextlib.contextmanager
def self_attention_only(visual: nn.Module) -> Iterator[None]:
    """Inside, the last block of an open_clip ``VisionTransformer`` lets each token attend only to
    itself (MaskCLIP's value path)."""
    attn = visual.transformer.resblocks[-1].attn
    if not isinstance(attn, nn.MultiheadAttention):
        raise TypeError(f"the value path needs open_clip's nn.MultiheadAttention blocks, not {type(attn).__name__}")

    def mask(_m, args, kwargs):
        tokens = args[0].shape[1] if attn.batch_first else args[0].shape[0]
        diagonal = torch.full((tokens, tokens), float("-inf"), dtype=args[0].dtype, device=args[0].device)
        return args, {**kwargs, "attn_mask": diagonal.fill_diagonal_(0.0)}  # (T, T): 0 keeps, -inf drops

    handle = attn.register_forward_pre_hook(mask, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def patch_embeddings(model: nn.Module, images: Tensor, value_path: bool = False) -> Tensor:
    """Every token of the image tower in the joint embedding space, not normalised.

    Args:
        model: an mmssl ``CLIP`` in eval mode (``forward_features`` is open_clip's last block
            output after ``ln_post``).
        images: (B, 3, H, W) normalised images.
        value_path: MaskCLIP's last layer (see the module docstring).

    Returns:
        (B, 1+L, D): token 0 is the cls token, equal to ``encode_image(images, normalize=False)``
        for cls pooling without ``value_path``; then the L patches in row-major order.
    """
    visual = _visual(model)
    with self_attention_only(visual) if value_path else contextlib.nullcontext():
        tokens = model.forward_features(images)  # (B, 1+L, width), after ln_post
    if visual.proj is not None:
        tokens = tokens @ visual.proj  # (B, 1+L, D)
    return tokens


@torch.no_grad()
def similarity_maps(model: nn.Module, images: Tensor, texts: Sequence[str], value_path: bool = False) -> Tensor:
    """Cosine similarity of every patch with every text.

    Args:
        model: an mmssl ``CLIP`` (with ``tokenizer``) in eval mode.
        images: (B, 3, H, W) normalised images.
        texts: Q captions or queries.
        value_path: MaskCLIP's last layer (see the module docstring).

    Returns:
        (B, Q, h, w) cosine similarities in [-1, 1].
    """
    if not texts:
        raise ValueError("similarity_maps needs at least one text")
    h, w = grid_size(model)
    patches = F.normalize(patch_embeddings(model, images, value_path)[:, 1:].float(), dim=-1)  # (B, L, D)
    tokens = model.tokenizer(list(texts)).to(images.device)
    text = F.normalize(model.encode_text(tokens, normalize=False).float(), dim=-1)  # (Q, D)
    similarity = patches @ text.T  # (B, L, Q)
    return similarity.transpose(1, 2).reshape(images.shape[0], len(texts), h, w)
